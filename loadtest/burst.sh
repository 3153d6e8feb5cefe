#!/usr/bin/env bash
# Admission under load (issue 12's targets; on demand, never in scripts/test), one replica on
# PostgreSQL and Redis with every key limit set (loadtest/stack.sh), one team:
#
#   MODE=admit  new streams admitted per second with the full lifecycle: a fresh Idempotency-Key
#               per request, max_tokens 1, against a simulator answering in 1 ms; STREAMS
#               (default 200) concurrent workers for DURATION (20s).
#   MODE=burst  STREAMS (default 10000) concurrent streams of one team against a simulator at
#               1 s to the first token and 2 s per token, 30 tokens each, for DURATION (60s);
#               node_concurrency raised so nothing queues at the gateway.
#
# Prints the outcomes by code, requests per second, TTFT, peak RSS of the gateway and the agent,
# and the ledger's rows by status once every stream ended (none may stay reserved).
#
#   cargo build --release --bins --workspace && MODE=burst loadtest/burst.sh
#
# Env: MODE (burst), STREAMS, DURATION, WORK (/tmp/switchyard-burst), the stack's
# (loadtest/stack.sh: BIN_DIR, DATABASE, REDIS_URL).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${MODE:-burst}
WORK=${WORK:-/tmp/switchyard-burst}
case "$MODE" in
  admit) TTFT_MS=1 ITL_MS=1; STREAMS=${STREAMS:-200}; DURATION=${DURATION:-20s}; MAX_TOKENS=1
         EXTRA=(--idempotency-keys) ;;
  burst) TTFT_MS=1000 ITL_MS=2000; STREAMS=${STREAMS:-10000}; DURATION=${DURATION:-60s}; MAX_TOKENS=30
         EXTRA=() ;;
  *) echo "MODE is admit or burst" >&2; exit 2 ;;
esac
NODE_CONCURRENCY=$((STREAMS * 2)) MAX_WAITING=$((STREAMS * 2))
source loadtest/stack.sh

"$LT" run --url "$GW/v1" --key "$KEY" --model tiny --streams "$STREAMS" --duration "$DURATION" \
  --prompt-tokens 50 --max-tokens "$MAX_TOKENS" --timeout 600s --no-progress \
  "${EXTRA[@]}" --out "$WORK/$MODE.json" > "$WORK/$MODE.txt"
python3 - "$WORK/$MODE.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
o = r["overall_wall_clock"]
print("outcomes:", r["outcomes"])
print(f"requests {o['requests']}  completed {o['completed']}  requests/s {o['requests_per_s']:.0f}  "
      f"TTFT p50 {o['ttft_ms']['p50']:.1f} ms  p99 {o['ttft_ms']['p99']:.1f} ms")
PY
echo "peak RSS: gateway $(grep VmHWM /proc/$GW_PID/status | awk '{print $2/1024 " MiB"}'), agent $(grep VmHWM /proc/$AGENT_PID/status | awk '{print $2/1024 " MiB"}')"
for _ in $(seq 1 120); do
  open=$(psql "$DBURL" -tAc "SELECT count(*) FROM usage_ledger WHERE status = 'reserved'")
  [ "$open" = 0 ] && break; sleep 1
done
echo "ledger rows by status: $(psql "$DBURL" -tAc "SELECT string_agg(status || ' ' || n, ', ') FROM (SELECT status, count(*) n FROM usage_ledger GROUP BY status) s")"
