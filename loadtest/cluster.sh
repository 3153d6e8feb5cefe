#!/usr/bin/env bash
# The cross-replica relay, measured (issue 13's benchmark; on demand, never in scripts/test):
# REPLICAS (3) `serve` replicas on one PostgreSQL and Redis, a fixed-timing simulator (50 ms to
# the first token, 20 ms per token, 64 tokens) whose agent dials the first replica, which also
# owns the model's queue (it starts first). `switchyard-loadtest compare` sends the same load
# to the simulator directly and through:
#   local    the first replica: node and queue on the replica the request enters, no pub/sub;
#   relayed  the second replica: the enqueue, the dispatch, the assignment and every frame
#            cross Redis (queue owner and node socket are both elsewhere);
#   spread   every replica in turn (as a load balancer would), for throughput, at SPREAD.
# One JSON per run goes to $WORK, its table to stdout.
#
#   cargo build --release --bins --workspace && loadtest/cluster.sh
#
# Env: STREAMS ("1 200"), SPREAD (200), DURATION (10s per phase), ROUNDS (2), REPLICAS (3),
# WORK (/tmp/switchyard-cluster), the stack's (loadtest/stack.sh: BIN_DIR, DATABASE, REDIS_URL).
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${STREAMS:-"1 200"}
SPREAD=${SPREAD:-200}
DURATION=${DURATION:-10s}
ROUNDS=${ROUNDS:-2}
REPLICAS=${REPLICAS:-3}
WORK=${WORK:-/tmp/switchyard-cluster}
TTFT_MS=50 ITL_MS=20
source loadtest/stack.sh
if [ "$REPLICAS" -lt 2 ]; then echo "REPLICAS must be at least 2" >&2; exit 2; fi

compare() {
  local name=$1 url=$2 n=$3
  echo "== $name, $n concurrent streams ($url)"
  "$LT" compare --direct-url "http://127.0.0.1:$ENGINE_PORT/v1" --direct-model tiny \
    --gateway-url "$url" --gateway-key "$KEY" --gateway-model tiny \
    --streams "$n" --duration "$DURATION" --rounds "$ROUNDS" --prompt-tokens 500 --max-tokens 64 \
    --json "$WORK/cluster-$name-$n.json" --no-progress
}

for n in $STREAMS; do
  compare local "$GW/v1" "$n"
  compare relayed "${GWS[1]}/v1" "$n"
done
all=$(printf '%s/v1,' "${GWS[@]}"); all=${all%,}
compare spread "$all" "$SPREAD"
for i in "${!GW_PIDS[@]}"; do
  echo "replica $i RSS: $(grep VmHWM /proc/${GW_PIDS[$i]}/status)"
done
