#!/usr/bin/env bash
# The cross-replica relay, measured (issue 13's benchmark; on demand, never in scripts/test).
# `switchyard-loadtest bench --scenarios relay` measures local and relayed; this script remains
# for the `remote` and `spread` paths:
# REPLICAS (3) `serve` replicas on one PostgreSQL and Redis, a fixed-timing simulator (50 ms to
# the first token, 20 ms per token, 64 tokens) whose agent dials the first replica, which also
# owns the model's queue (it starts first). Two teams: the first's budget is owned by the
# first replica, the second's by the second replica (its first request enters there).
# `switchyard-loadtest compare` sends the same load to the simulator directly and through:
#   local    the first replica, first team: node socket, queue and budget where the request
#            enters, no pub/sub;
#   relayed  the second replica, second team: budget there, the queue's decision there (on
#            the owner's capacity grant), the node's socket on the first replica — the
#            `assign` and every frame cross Redis: the relay's own cost, against `local`;
#   remote   the second replica, first team: the budget's ask and answer cross Redis too
#            (what a request entering a replica that owns nothing pays);
#   spread   every replica in turn (as a load balancer would), for throughput, at SPREAD.
# One JSON per run goes to $WORK, its table to stdout.
#
#   cargo build --release --bins --workspace && loadtest/cluster.sh
#
# Env: STREAMS ("1 200"), SPREAD (200; 0 skips it), DURATION (10s per phase), ROUNDS (2),
# MAX_TOKENS (64; fewer make more requests per phase: TTFT percentiles on more samples), REPLICAS (3),
# WORK (/tmp/switchyard-cluster), the stack's (loadtest/stack.sh: BIN_DIR, DATABASE, REDIS_URL).
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${STREAMS:-"1 200"}
SPREAD=${SPREAD:-200}
DURATION=${DURATION:-10s}
ROUNDS=${ROUNDS:-2}
MAX_TOKENS=${MAX_TOKENS:-64}
REPLICAS=${REPLICAS:-3}
WORK=${WORK:-/tmp/switchyard-cluster}
TTFT_MS=50 ITL_MS=20
source loadtest/stack.sh
if [ "$REPLICAS" -lt 2 ]; then echo "REPLICAS must be at least 2" >&2; exit 2; fi

# The second team, its budget owned by the second replica (it decides its first request).
team2=$(adm POST /admin/teams '{"name":"bench-2"}' | json id)
adm POST /admin/credits "{\"team\":$team2,\"amount\":1000000000000000}" >/dev/null
KEY2=$(adm POST /admin/keys "{\"team\":$team2,\"rpm\":1000000,\"tokens_per_day\":1000000000000,\"max_streams\":${MAX_STREAMS:-100000}}" | json key)
curl -sS "${GWS[1]}/v1/chat/completions" -H "Authorization: Bearer $KEY2" \
  -H 'Content-Type: application/json' \
  --data '{"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}' >/dev/null

# A request a second through the first replica keeps the first team's budget there (an
# idle team's lease lapses, and the replica its next request enters takes it).
hold_budget() {
  while :; do
    curl -sS "$GW/v1/chat/completions" -H "Authorization: Bearer $KEY" \
      -H 'Content-Type: application/json' \
      --data '{"model":"tiny","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}' >/dev/null
    sleep 1
  done
}

compare() {
  local name=$1 url=$2 n=$3 key=${4:-$KEY}
  echo "== $name, $n concurrent streams ($url)"
  "$LT" compare --direct-url "http://127.0.0.1:$ENGINE_PORT/v1" --direct-model tiny \
    --gateway-url "$url" --gateway-key "$key" --gateway-model tiny \
    --streams "$n" --duration "$DURATION" --rounds "$ROUNDS" --prompt-tokens 500 --max-tokens "$MAX_TOKENS" \
    --json "$WORK/cluster-$name-$n.json" --no-progress
}

for n in $STREAMS; do
  compare local "$GW/v1" "$n"
  compare relayed "${GWS[1]}/v1" "$n" "$KEY2"
  hold_budget & holder=$!
  compare remote "${GWS[1]}/v1" "$n"
  kill "$holder"; wait "$holder" 2>/dev/null || true
done
all=$(printf '%s/v1,' "${GWS[@]}"); all=${all%,}
if [ "$SPREAD" != 0 ]; then compare spread "$all" "$SPREAD"; fi
for i in "${!GW_PIDS[@]}"; do
  echo "replica $i RSS: $(grep VmHWM /proc/${GW_PIDS[$i]}/status)"
done
