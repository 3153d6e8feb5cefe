#!/usr/bin/env bash
# The gateway's overhead, measured (issue 12's benchmark; on demand, never in scripts/test):
# a fixed-timing simulator (50 ms to the first token, 20 ms per token, 64 tokens), `serve` on
# PostgreSQL and Redis with a key whose rpm, tokens/day and max_streams are all set, one node
# agent; `switchyard-loadtest compare` sends the same load to the simulator directly and
# through the gateway, alternating, at each concurrency in STREAMS, and writes one JSON per
# concurrency to $WORK plus its table on stdout.
#
#   cargo build --release --bins --workspace && loadtest/overhead.sh
#
# Env: BIN_DIR (target/release), STREAMS ("1 50 200"), DURATION (15s per phase), ROUNDS (2),
# DATABASE (postgres://postgres@127.0.0.1:5432/postgres: a database `sybench_<random>` is made
# there and dropped), REDIS_URL (redis://127.0.0.1:6379), WORK (/tmp/switchyard-overhead),
# PERF (set: `perf record` the gateway during each concurrency's compare, with DWARF call
# graphs, to $WORK/gateway-<n>.perf.data; read it with `perf report -i …`; the sampling adds
# to the CPU figures of that run, so leave it off for them).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN_DIR=${BIN_DIR:-target/release}
SY="$BIN_DIR/switchyard"
LT="$BIN_DIR/switchyard-loadtest"
STREAMS=${STREAMS:-"1 50 200"}
DURATION=${DURATION:-15s}
ROUNDS=${ROUNDS:-2}
WORK=${WORK:-/tmp/switchyard-overhead}
PG=${DATABASE:-postgres://postgres@127.0.0.1:5432/postgres}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
DB=sybench_$RANDOM$RANDOM
ENGINE_PORT=${ENGINE_PORT:-18300}
GW_PORT=${GW_PORT:-18380}
ADMIN=adm-bench-$RANDOM$RANDOM
mkdir -p "$WORK"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  psql "$PG" -qc "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true
}
trap cleanup EXIT

psql "$PG" -qc "CREATE DATABASE $DB" >/dev/null
DBURL="${PG%/*}/$DB"

"$SY" sim --listen "127.0.0.1:$ENGINE_PORT" --model tiny --profile fixed --ttft-ms 50 --itl-ms 20 \
  > "$WORK/sim.log" 2>&1 &
ENGINE_PID=$!; pids+=($ENGINE_PID)

cat > "$WORK/switchyard.toml" <<TOML
listen = "127.0.0.1:$GW_PORT"
[[models]]
name = "tiny"
price_input_per_mtok = 1000
price_output_per_mtok = 2000
node_concurrency = 1000
max_context_tokens = 8192
[queue]
max_waiting = 10000
TOML
DATABASE_URL="$DBURL" REDIS_URL="$REDIS_URL" SWITCHYARD_REPLICA_ID=bench \
  SWITCHYARD_ADMIN_TOKEN=$ADMIN "$SY" serve --config "$WORK/switchyard.toml" > "$WORK/serve.log" 2>&1 &
GW_PID=$!; pids+=($GW_PID)
GW=http://127.0.0.1:$GW_PORT
for _ in $(seq 1 120); do curl -sf "$GW/healthz" >/dev/null && break; sleep 0.5; done
adm() { curl -sS -X "$1" "$GW$2" -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' ${3:+--data "$3"}; }
json() { python3 -c "import json,sys; print(json.load(sys.stdin)[\"$1\"])"; }
team=$(adm POST /admin/teams '{"name":"bench"}' | json id)
adm POST /admin/credits "{\"team\":$team,\"amount\":1000000000000000}" >/dev/null
# Every key limit set, so every admission runs every check.
KEY=$(adm POST /admin/keys "{\"team\":$team,\"rpm\":1000000,\"tokens_per_day\":1000000000000,\"max_streams\":100000}" | json key)
NODE_TOKEN=$(adm POST /admin/nodes '{"node_id":"bench-1","location":"cloud"}' | json token)
SWITCHYARD_NODE_TOKEN=$NODE_TOKEN "$SY" node --server "$GW" --node-id bench-1 \
  --engine "http://127.0.0.1:$ENGINE_PORT" --location cloud > "$WORK/node.log" 2>&1 &
AGENT_PID=$!; pids+=($AGENT_PID)
for _ in $(seq 1 60); do adm GET /admin/nodes '' | grep -q '"health":"ready"' && break; sleep 0.5; done

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
