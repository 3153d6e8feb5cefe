#!/usr/bin/env bash
# The gateway's overhead, measured (issue 12's benchmark; on demand, never in scripts/test).
# The suite (`switchyard-loadtest bench`, docs/loadtest.md) measures the same and more; this
# script remains for PERF=1, a profile of the gateway under that load:
# a fixed-timing simulator (50 ms to the first token, 20 ms per token, 64 tokens), `serve` on
# PostgreSQL and Redis with a key whose rpm, tokens/day and max_streams are all set, one node
# agent; `switchyard-loadtest compare` sends the same load to the simulator directly and
# through the gateway, alternating, at each concurrency in STREAMS, and writes one JSON per
# concurrency to $WORK plus its table on stdout.
#
#   cargo build --release --bins --workspace && loadtest/overhead.sh
#
# Env: STREAMS ("1 50 200"), DURATION (15s per phase), ROUNDS (2), WORK
# (/tmp/switchyard-overhead), the stack's (loadtest/stack.sh: BIN_DIR, DATABASE, REDIS_URL),
# PERF (set: `perf record` the gateway during each concurrency's compare, with DWARF call
# graphs, to $WORK/gateway-<n>.perf.data; read it with `perf report -i …`; the sampling adds
# to the CPU figures of that run, so leave it off for them).
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${STREAMS:-"1 50 200"}
DURATION=${DURATION:-15s}
ROUNDS=${ROUNDS:-2}
WORK=${WORK:-/tmp/switchyard-overhead}
TTFT_MS=50 ITL_MS=20
source loadtest/stack.sh

for n in $STREAMS; do
  echo "== $n concurrent streams"
  prof=
  if [ -n "${PERF:-}" ]; then
    perf record -q -F 499 --call-graph dwarf,16384 -p "$GW_PID" -o "$WORK/gateway-$n.perf.data" \
      > "$WORK/perf-$n.log" 2>&1 &
    prof=$!
  fi
  "$LT" compare --direct-url "http://127.0.0.1:$ENGINE_PORT/v1" --direct-model tiny \
    --gateway-url "$GW/v1" --gateway-key "$KEY" --gateway-model tiny \
    --streams "$n" --duration "$DURATION" --rounds "$ROUNDS" --prompt-tokens 500 --max-tokens 64 \
    --gateway-pid "$GW_PID" --agent-pid "$AGENT_PID" --engine-pid "$ENGINE_PID" \
    --json "$WORK/compare-$n.json" --no-progress
  if [ -n "$prof" ]; then kill -INT "$prof" 2>/dev/null || true; wait "$prof" 2>/dev/null || true; fi
done
echo "server RSS: $(grep VmHWM /proc/$GW_PID/status)  agent: $(grep VmHWM /proc/$AGENT_PID/status)"
