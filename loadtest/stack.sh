# Sourced by the on-demand benchmarks (overhead.sh, cluster.sh): starts a fixed-timing simulator,
# `serve` on a fresh PostgreSQL database and Redis, a team with credits, a key with every limit
# set (so every admission runs every check) and one node agent; stops them and drops the
# database on exit. Before sourcing, set TTFT_MS and ITL_MS (the simulator's timing) and
# optionally NODE_CONCURRENCY (1000), MAX_WAITING (10000), MAX_STREAMS (100000) and REPLICAS
# (1: more start further `serve` replicas on the next ports, sharing the database, Redis and a
# key prefix of their own; the first starts first, so it owns every queue, and the node dials
# it). Afterwards: SY, LT, GW, KEY, ENGINE_PORT, ENGINE_PID, GW_PID, AGENT_PID, WORK, and
# GWS / GW_PIDS (every replica's URL / pid, the first one first).
#
# Env: BIN_DIR (target/release), DATABASE (postgres://postgres@127.0.0.1:5432/postgres: a
# database `sybench_<random>` is made there and dropped), REDIS_URL (redis://127.0.0.1:6379),
# WORK (/tmp/switchyard-bench), ENGINE_PORT (18300), GW_PORT (18380).
BIN_DIR=${BIN_DIR:-target/release}
SY="$BIN_DIR/switchyard"
LT="$BIN_DIR/switchyard-loadtest"
WORK=${WORK:-/tmp/switchyard-bench}
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

"$SY" sim --listen "127.0.0.1:$ENGINE_PORT" --model tiny --profile fixed \
  --ttft-ms "$TTFT_MS" --itl-ms "$ITL_MS" > "$WORK/sim.log" 2>&1 &
ENGINE_PID=$!; pids+=($ENGINE_PID)

cat > "$WORK/switchyard.toml" <<TOML
[[models]]
name = "tiny"
price_input_per_mtok = 1000
price_output_per_mtok = 2000
node_concurrency = ${NODE_CONCURRENCY:-1000}
max_context_tokens = 8192
[queue]
max_waiting = ${MAX_WAITING:-10000}
[listener]
# Every connection comes from the load generator on this host.
max_connections_per_client = 0
TOML
PREFIX="sybench-$RANDOM$RANDOM:"
GWS=() GW_PIDS=()
for i in $(seq 0 $(( ${REPLICAS:-1} - 1 ))); do
  port=$(( GW_PORT + i ))
  DATABASE_URL="$DBURL" REDIS_URL="$REDIS_URL" SWITCHYARD_REPLICA_ID=bench-$i \
    SWITCHYARD_REDIS_PREFIX="$PREFIX" SWITCHYARD_LISTEN="127.0.0.1:$port" \
    SWITCHYARD_ADMIN_TOKEN=$ADMIN "$SY" serve --config "$WORK/switchyard.toml" \
    > "$WORK/serve-$i.log" 2>&1 &
  GW_PIDS+=($!); pids+=($!)
  GWS+=("http://127.0.0.1:$port")
  for _ in $(seq 1 120); do curl -sf "${GWS[$i]}/healthz" >/dev/null && break; sleep 0.5; done
done
GW_PID=${GW_PIDS[0]}
GW=${GWS[0]}
adm() { curl -sS -X "$1" "$GW$2" -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' ${3:+--data "$3"}; }
json() { python3 -c "import json,sys; print(json.load(sys.stdin)[\"$1\"])"; }
team=$(adm POST /admin/teams '{"name":"bench"}' | json id)
adm POST /admin/credits "{\"team\":$team,\"amount\":1000000000000000}" >/dev/null
KEY=$(adm POST /admin/keys "{\"team\":$team,\"rpm\":1000000,\"tokens_per_day\":1000000000000,\"max_streams\":${MAX_STREAMS:-100000}}" | json key)
NODE_TOKEN=$(adm POST /admin/nodes '{"node_id":"bench-1","location":"cloud"}' | json token)
SWITCHYARD_NODE_TOKEN=$NODE_TOKEN "$SY" node --server "$GW" --node-id bench-1 \
  --engine "http://127.0.0.1:$ENGINE_PORT" --location cloud > "$WORK/node.log" 2>&1 &
AGENT_PID=$!; pids+=($AGENT_PID)
for _ in $(seq 1 60); do adm GET /admin/nodes '' | grep -q '"health":"ready"' && break; sleep 0.5; done
