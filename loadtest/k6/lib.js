// Shared by the k6 scenarios: one streaming chat completion, measured and checked.
//
// k6 has no native SSE, so a stream is measured as time to first byte (the response head,
// sent when the request is admitted) and whole-request time; per-token figures come from
// `switchyard-loadtest run`. Env: BASE_URL (the platform's /v1), API_KEY, MODEL,
// MAX_TOKENS (64), PROMPT (a short question).
import http from 'k6/http';
import { check } from 'k6';
import { Counter, Trend } from 'k6/metrics';

export const BASE = (__ENV.BASE_URL || 'http://127.0.0.1:8080/v1').replace(/\/$/, '');
const KEY = __ENV.API_KEY || '';
const MODEL = __ENV.MODEL || 'llama-3.1-8b-instruct';
const MAX_TOKENS = parseInt(__ENV.MAX_TOKENS || '64', 10);
const PROMPT = __ENV.PROMPT || 'Name three rivers of Europe and say where each one rises.';

const firstByte = new Trend('stream_first_byte', true);
const whole = new Trend('stream_whole', true);
const refused = new Counter('refused');

// The stream's events, parsed: `data:` lines other than `[DONE]` (an unparseable one is
// kept as `null`, and fails the checks).
function events(text) {
  return text
    .split('\n')
    .filter((l) => l.startsWith('data: ') && l !== 'data: [DONE]')
    .map((l) => {
      try {
        return JSON.parse(l.slice(6));
      } catch (_) {
        return null;
      }
    });
}

export function streamChat() {
  const body = JSON.stringify({
    model: MODEL,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: MAX_TOKENS,
    messages: [{ role: 'user', content: PROMPT }],
  });
  const res = http.post(`${BASE}/chat/completions`, body, {
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${KEY}` },
    timeout: '180s',
    tags: { name: 'chat_stream' },
  });
  if (res.status === 429 || res.status === 503) {
    // Refused by a limit or the queue: counted, not a failure of the platform.
    refused.add(1, { status: String(res.status) });
    check(res, { 'refusal carries Retry-After': (r) => r.headers['Retry-After'] !== undefined });
    return;
  }
  firstByte.add(res.timings.waiting);
  whole.add(res.timings.duration);
  const text = typeof res.body === 'string' ? res.body : '';
  const seen = events(text);
  // The usage chunk a stream with `include_usage` ends with, before `[DONE]`.
  const usage = seen.length > 0 && seen[seen.length - 1] ? seen[seen.length - 1].usage : null;
  check(res, {
    'status is 200': (r) => r.status === 200,
    'is an event stream': (r) => (r.headers['Content-Type'] || '').startsWith('text/event-stream'),
    'every event is JSON': () => seen.every((e) => e !== null),
    'has a usage chunk': () => usage !== null && usage !== undefined && usage.completion_tokens > 0,
    'ends with [DONE]': () => text.trimEnd().endsWith('data: [DONE]'),
    'no error event': () => seen.every((e) => e === null || e.error === undefined),
  });
}
