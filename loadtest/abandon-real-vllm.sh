#!/usr/bin/env bash
# Issue 34 item 0 against a real vLLM: a metered key's streamed chat completion of 900 tokens
# without Idempotency-Key, abandoned after five chunks, must stop on the engine at once and be
# billed only what the engine made. Starts vLLM (unless VLLM_RUNNING is set), `serve` on SQLite
# and one node agent; prints how long the engine ran on after the close, what it generated and
# what the ledger billed.
#
#   loadtest/abandon-real-vllm.sh
#
# Needs ../shared/tools/real-vllm (vLLM 0.32.0 CPU, tiny random Llama) and a built binary.
# Env: SWITCHYARD_BIN (target/debug/switchyard), VLLM_PORT (18500), GW_PORT (18580),
#      WORK (/tmp/abandon-real-vllm), REAL_VLLM (the real-vllm launcher).
# Measured 2026-12-08: the engine idle 24 ms after the close, 5 tokens generated, 5 billed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
REAL_VLLM=${REAL_VLLM:-$here/../../shared/tools/real-vllm/real-vllm}
SY=${SWITCHYARD_BIN:-$here/../target/debug/switchyard}
VLLM_PORT=${VLLM_PORT:-18500}
GW_PORT=${GW_PORT:-18580}
WORK=${WORK:-/tmp/abandon-real-vllm}
GW=http://127.0.0.1:$GW_PORT
ENGINE=http://127.0.0.1:$VLLM_PORT
ADMIN=adm-abandon-$RANDOM$RANDOM
rm -rf "$WORK"; mkdir -p "$WORK"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

if [ -z "${VLLM_RUNNING:-}" ]; then
  "$REAL_VLLM" serve "$VLLM_PORT" tiny > "$WORK/vllm.log" 2>&1 & pids+=($!)
  "$REAL_VLLM" wait "$VLLM_PORT"
fi
cat > "$WORK/switchyard.toml" <<TOML
database_url = "sqlite://$WORK/sy.db?mode=rwc"
listen = "127.0.0.1:$GW_PORT"
admin_token = "$ADMIN"
[[models]]
name = "tiny"
price_input_per_mtok = 1000
price_output_per_mtok = 2000
node_concurrency = 8
max_context_tokens = 1024
TOML
"$SY" serve --config "$WORK/switchyard.toml" > "$WORK/serve.log" 2>&1 & pids+=($!)
for _ in $(seq 100); do curl -sf "$GW/healthz" >/dev/null && break; sleep 0.2; done
adm() { curl -sf -H "authorization: Bearer $ADMIN" -H 'content-type: application/json' -d "$2" "$GW$1"; }
field() { python3 -c "import sys, json; print(json.load(sys.stdin)['$1'])"; }
adm /admin/teams '{"name":"abandon"}' >/dev/null
adm /admin/credits '{"team":"abandon","amount":1000000000000}' >/dev/null
# A burst bucket makes the key's messages metered: its requests get a lifecycle record.
KEY=$(adm /admin/keys '{"team":"abandon","burst_capacity":20}' | field key)
TOKEN=$(adm /admin/nodes '{"node_id":"real","location":"onprem"}' | field token)
"$SY" node --server "$GW" --node-id real --token "$TOKEN" --engine "$ENGINE" \
  > "$WORK/node.log" 2>&1 & pids+=($!)
for _ in $(seq 100); do
  curl -sf -H "authorization: Bearer $KEY" "$GW/v1/models" | grep -q tiny && break; sleep 0.2
done
sleep 2
metric() { curl -s "$ENGINE/metrics" | awk -v m="$1" '$1 ~ "^"m {s+=$2} END{print s+0}'; }
before=$(metric vllm:generation_tokens_total)
KEY=$KEY GW_PORT=$GW_PORT python3 - <<'PY'
import json, os, socket
body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story."}],
                   "max_tokens": 900, "stream": True, "ignore_eos": True}).encode()
s = socket.create_connection(("127.0.0.1", int(os.environ["GW_PORT"])))
s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
          + os.environ["KEY"].encode() + b"\r\ncontent-type: application/json\r\ncontent-length: "
          + str(len(body)).encode() + b"\r\n\r\n" + body)
buf = b""
while buf.count(b"data: ") < 6:
    buf += s.recv(4096)
s.close()
PY
closed=$(date +%s.%N)
while [ "$(metric vllm:num_requests_running)" != 0 ]; do sleep 0.02; done
idle=$(date +%s.%N)
sleep 2
after=$(metric vllm:generation_tokens_total)
echo "the engine was idle $(python3 -c "print(round(($idle - $closed) * 1000))") ms after the client closed"
echo "the engine generated $((after - before)) tokens"
curl -s -H "authorization: Bearer $KEY" "$GW/v1/usage?from=2000-01-01T00:00:00Z&to=2100-01-01T00:00:00Z" \
  | python3 -c "import sys, json; d = json.load(sys.stdin)['data'][0]; print('the ledger billed', d['completion_tokens'], 'completion tokens and', d['prompt_tokens'], 'prompt tokens')"
