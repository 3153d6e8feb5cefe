// Steady streaming load: VUS clients each sending one stream after another for DURATION.
//   k6 run -e BASE_URL=https://llm.example.com/v1 -e API_KEY=sk-... -e VUS=50 loadtest/k6/chat.js
import { streamChat } from './lib.js';

export const options = {
  scenarios: {
    chat: {
      executor: 'constant-vus',
      vus: parseInt(__ENV.VUS || '8', 10),
      duration: __ENV.DURATION || '30s',
    },
  },
  thresholds: {
    checks: ['rate>0.99'],
    stream_first_byte: [`p(95)<${__ENV.FIRST_BYTE_P95_MS || '2000'}`],
  },
};

export default function () {
  streamChat();
}
