// New streams per second, ramping: the arrival rate goes from 1/s to RATE/s over DURATION
// whatever the latency (an open model: slow answers do not slow the arrivals). Refusals
// (429/503 with Retry-After) are counted in `refused`; every answered stream is checked.
//   k6 run -e BASE_URL=... -e API_KEY=... -e RATE=200 loadtest/k6/arrivals.js
import { streamChat } from './lib.js';

const RATE = parseInt(__ENV.RATE || '20', 10);

export const options = {
  scenarios: {
    arrivals: {
      executor: 'ramping-arrival-rate',
      startRate: 1,
      timeUnit: '1s',
      preAllocatedVUs: Math.max(10, RATE * 2),
      maxVUs: Math.max(50, RATE * 20),
      stages: [{ target: RATE, duration: __ENV.DURATION || '60s' }],
    },
  },
  thresholds: { checks: ['rate>0.99'] },
};

export default function () {
  streamChat();
}
