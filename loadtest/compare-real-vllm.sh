#!/usr/bin/env bash
# Compare a real vLLM's answers DIRECTLY with the same answers THROUGH Switchyard
# (switchyard serve + switchyard node in front of the same vLLM), request by request.
#
#   loadtest/compare-real-vllm.sh            # starts vLLM, serve and node, compares, stops them
#   KEEP_VLLM=1 VLLM_RUNNING=1 loadtest/compare-real-vllm.sh   # reuse a vLLM already on $VLLM_PORT
#
# Needs: ../shared/tools/real-vllm (vLLM 0.32.0 CPU, tiny random Llama) and a release binary:
#   CARGO_TARGET_DIR=/tmp/cmp-target cargo build --release --bin switchyard
# Env: SWITCHYARD_BIN (default /tmp/cmp-target/release/switchyard), VLLM_PORT (18000),
#      GW_PORT (18080), WORK (/tmp/cmp-real-vllm), PY (a python with `requests`; default the
#      real-vllm venv's), REAL_VLLM (path of the real-vllm launcher).
# Prints every comparison as direct vs gateway and ends with the list of differences.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
REAL_VLLM=${REAL_VLLM:-$here/../../shared/tools/real-vllm/real-vllm}
SWITCHYARD_BIN=${SWITCHYARD_BIN:-/tmp/cmp-target/release/switchyard}
VLLM_PORT=${VLLM_PORT:-18000}
GW_PORT=${GW_PORT:-18080}
WORK=${WORK:-/tmp/cmp-real-vllm}
PY=${PY:-${REAL_VLLM_HOME:-$HOME/.cache/switchyard-real-vllm}/venv/bin/python}
ADMIN=adm-compare-$RANDOM$RANDOM
MODEL=tiny
mkdir -p "$WORK"
rm -rf "$WORK"/sy.db* "$WORK/raw"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

if [ -z "${VLLM_RUNNING:-}" ]; then
  # pythonic: llama3_json does not start with the tiny tokenizer. disable_any_whitespace: with
  # whitespace allowed the random model writes spaces until max_tokens in every forced call.
  "$REAL_VLLM" serve "$VLLM_PORT" "$MODEL" --enable-auto-tool-choice --tool-call-parser pythonic \
    --enable-prompt-tokens-details --enable-prefix-caching --enable-log-requests \
    --structured-outputs-config '{"backend":"xgrammar","disable_any_whitespace": true}' \
    > "$WORK/vllm.log" 2>&1 &
  [ -n "${KEEP_VLLM:-}" ] || pids+=($!)
fi
"$REAL_VLLM" wait "$VLLM_PORT"
VLLM_LOG=${VLLM_LOG:-$WORK/vllm.log}

cat > "$WORK/switchyard.toml" <<EOF
listen = "127.0.0.1:$GW_PORT"
database_url = "sqlite://$WORK/sy.db?mode=rwc"
[[models]]
name = "$MODEL"
price_input_per_mtok = 1000000
price_output_per_mtok = 2000000
node_concurrency = 4
default_max_tokens = 64
max_context_tokens = 1024
EOF
SWITCHYARD_ADMIN_TOKEN=$ADMIN "$SWITCHYARD_BIN" serve --config "$WORK/switchyard.toml" > "$WORK/serve.log" 2>&1 &
pids+=($!)
GW=http://127.0.0.1:$GW_PORT
for _ in $(seq 1 60); do curl -sf "$GW/healthz" >/dev/null && break; sleep 0.5; done
adm() { curl -sS -X "$1" "$GW$2" -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' ${3:+--data "$3"}; }
team=$(adm POST /admin/teams '{"name":"compare"}' | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["id"])')
adm POST /admin/credits "{\"team\":$team,\"amount\":1000000000000}" >/dev/null
KEY=$(adm POST /admin/keys "{\"team\":$team}" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["key"])')
NODE_TOKEN=$(adm POST /admin/nodes '{"node_id":"n1"}' | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["token"])')
SWITCHYARD_NODE_TOKEN=$NODE_TOKEN "$SWITCHYARD_BIN" node --server "$GW" --node-id n1 \
  --engine "http://127.0.0.1:$VLLM_PORT" > "$WORK/node.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 60); do
  adm GET /admin/nodes '' | grep -q '"health":"ready"' && break; sleep 0.5
done
adm GET /admin/nodes ''; echo

cat > "$WORK/compare.py" <<'PYEOF'
import json, os, re, sys, time
import requests

D = "http://127.0.0.1:%s" % os.environ["VLLM_PORT"]
G = "http://127.0.0.1:%s" % os.environ["GW_PORT"]
KEY = os.environ["KEY"]; MODEL = os.environ["MODEL"]; VLLM_LOG = os.environ["VLLM_LOG"]
FINDINGS = []
USAGE = {"direct": [0, 0, 0], "gateway": [0, 0, 0]}  # prompt, completion, requests

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
     "parameters": {"type": "object", "properties": {
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
         "required": ["unit", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time",
     "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
         "required": ["tz"], "additionalProperties": False}}},
]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
BASE = {"model": MODEL, "temperature": 0, "seed": 1234}
TOOLID = re.compile(r"chatcmpl-tool-[0-9a-f]+")


def cmp(label, direct, gateway, note=""):
    same = direct == gateway
    print("  %-34s %s" % (label, "EQUAL" if same else "DIFFERS"))
    if not same:
        print("      direct : %s" % json.dumps(direct)[:600])
        print("      gateway: %s" % json.dumps(gateway)[:600])
        FINDINGS.append((CURRENT, label, direct, gateway, note))
    return same


def count(side, usage):
    if usage:
        USAGE[side][0] += usage["prompt_tokens"]; USAGE[side][1] += usage["completion_tokens"]
    USAGE[side][2] += 1


def call(side, path, body, headers=None):
    url, h = (D, {}) if side == "direct" else (G, {"Authorization": "Bearer " + KEY})
    h.update(headers or {})
    r = requests.post(url + path, json=body, headers=h, stream=bool(body.get("stream")), timeout=300)
    if r.status_code != 200:
        print("  %s %s -> %s %s" % (side, path, r.status_code, r.text[:300]))
        FINDINGS.append((CURRENT, side + " status", r.status_code, r.text[:300], ""))
        return r, None
    if not body.get("stream"):
        j = r.json(); count(side, j.get("usage")); return r, j
    events = []
    for line in r.iter_lines(decode_unicode=False):
        if line.startswith(b"data: "):
            events.append(line[6:].decode("utf-8"))
    os.makedirs(os.environ["RAW"], exist_ok=True)
    fn = re.sub(r"[^a-z0-9]+", "_", CURRENT.lower()).strip("_")
    with open(os.path.join(os.environ["RAW"], "%s.%s.sse" % (fn, side)), "a") as f:
        f.write("".join("data: %s\n\n" % e for e in events))
    usage = None
    for e in events:
        if e != "[DONE]":
            u = json.loads(e).get("usage")
            if u: usage = u
    count(side, usage)
    return r, events


def raw_after(text, key, start=0):
    """The raw JSON text of the value after `"key":` (first at or after start), and its end."""
    i = text.index('"%s":' % key, start) + len(key) + 3
    _, end = json.JSONDecoder().raw_decode(text, i)
    return text[i:end], end


def pieces(events, dialect):
    """Per chunk with a choice: (raw delta or text, raw logprobs, finish_reason); plus the usage."""
    out, finish, usage, final = [], None, None, None
    for e in events:
        if e == "[DONE]":
            final = e; continue
        j = json.loads(e)
        if j.get("usage"): usage = j["usage"]
        if not j.get("choices"): continue
        c = j["choices"][0]
        if c.get("finish_reason"): finish = c["finish_reason"]
        if dialect == "chat":
            d, end = raw_after(e, "delta")
            lp, _ = raw_after(e, "logprobs", end)
            dj = json.loads(d)
            if "role" in dj: continue
            if (dj in ({}, {"content": ""}) or dj == {"tool_calls": [{"index": 0, "function": {"arguments": ""}}]}) and lp == "null":
                continue
        else:
            d, end = raw_after(e, "text")
            lp, _ = raw_after(e, "logprobs", end)
            if d == '""' and lp == "null": continue
        out.append((TOOLID.sub("chatcmpl-tool-X", d), lp))
    return out, finish, usage, final


def assemble_tools(events):
    calls = {}
    for e in events:
        if e == "[DONE]": continue
        j = json.loads(e)
        for c in j.get("choices", []):
            for tc in (c.get("delta") or {}).get("tool_calls") or []:
                k = calls.setdefault(tc["index"], {"id": None, "type": None, "name": None, "arguments": ""})
                if tc.get("id"): k["id"] = tc["id"]
                if tc.get("type"): k["type"] = tc["type"]
                f = tc.get("function") or {}
                if f.get("name"): k["name"] = f["name"]
                k["arguments"] += f.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def idshape(s):
    return None if s is None else re.sub(r"[0-9a-f]{8,}$", "<%d hex>" % len(re.search(r"[0-9a-f]*$", s).group()), s)


def usage3(u):
    if not u: return u
    return {k: u.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def tool_case(name, extra):
    global CURRENT
    body = dict(BASE, messages=MSG, tools=TOOLS, max_tokens=60, **extra)
    CURRENT = name + " non-stream"; print("\n== " + CURRENT)
    _, d = call("direct", "/v1/chat/completions", body)
    _, g = call("gateway", "/v1/chat/completions", body)
    if d and g:
        dm, gm = d["choices"][0]["message"], g["choices"][0]["message"]
        dt = [{"name": t["function"]["name"], "arguments": t["function"]["arguments"], "type": t["type"]} for t in dm.get("tool_calls") or []]
        gt = [{"name": t["function"]["name"], "arguments": t["function"]["arguments"], "type": t["type"]} for t in gm.get("tool_calls") or []]
        cmp("tool_calls name/arguments/type", dt, gt)
        cmp("tool call id shape", [idshape(t["id"]) for t in dm.get("tool_calls") or []], [idshape(t["id"]) for t in gm.get("tool_calls") or []])
        cmp("message.content", dm.get("content"), gm.get("content"))
        cmp("finish_reason", d["choices"][0]["finish_reason"], g["choices"][0]["finish_reason"])
        cmp("usage", usage3(d["usage"]), usage3(g["usage"]))
    CURRENT = name + " stream"; print("\n== " + CURRENT)
    sbody = dict(body, stream=True, stream_options={"include_usage": True})
    _, d = call("direct", "/v1/chat/completions", sbody)
    _, g = call("gateway", "/v1/chat/completions", sbody)
    if d and g:
        dc, gc = assemble_tools(d), assemble_tools(g)
        cmp("assembled name/arguments/type", [{k: c[k] for k in ("name", "arguments", "type")} for c in dc], [{k: c[k] for k in ("name", "arguments", "type")} for c in gc])
        cmp("tool call id shape", [idshape(c["id"]) for c in dc], [idshape(c["id"]) for c in gc])
        dp, df, du, _ = pieces(d, "chat"); gp, gf, gu, _ = pieces(g, "chat")
        cmp("delta bytes per chunk (ids masked)", [p[0] for p in dp], [p[0] for p in gp])
        cmp("finish_reason", df, gf)
        cmp("usage", usage3(du), usage3(gu))
        cmp("ends with [DONE]", d[-1], g[-1])


CURRENT = ""
tool_case("1 named tool call", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
tool_case("2 tool_choice required", {"tool_choice": "required"})

# 3. chat logprobs
body = dict(BASE, messages=[{"role": "user", "content": "Tell me a story about a cat."}], max_tokens=12, logprobs=True, top_logprobs=3)
CURRENT = "3 chat logprobs non-stream"; print("\n== " + CURRENT)
_, d = call("direct", "/v1/chat/completions", body); _, g = call("gateway", "/v1/chat/completions", body)
if d and g:
    cmp("content", d["choices"][0]["message"]["content"], g["choices"][0]["message"]["content"])
    cmp("logprobs (whole object)", d["choices"][0]["logprobs"], g["choices"][0]["logprobs"])
    cmp("finish_reason", d["choices"][0]["finish_reason"], g["choices"][0]["finish_reason"])
    cmp("usage", usage3(d["usage"]), usage3(g["usage"]))
CURRENT = "3 chat logprobs stream"; print("\n== " + CURRENT)
_, d = call("direct", "/v1/chat/completions", dict(body, stream=True, stream_options={"include_usage": True}))
_, g = call("gateway", "/v1/chat/completions", dict(body, stream=True, stream_options={"include_usage": True}))
if d and g:
    dp, df, du, _ = pieces(d, "chat"); gp, gf, gu, _ = pieces(g, "chat")
    cmp("delta bytes per chunk", [p[0] for p in dp], [p[0] for p in gp])
    cmp("logprobs bytes per chunk", [p[1] for p in dp], [p[1] for p in gp])
    cmp("finish_reason", df, gf)
    cmp("usage", usage3(du), usage3(gu))

# 4. legacy completions
body = dict(BASE, prompt="Once upon a time", max_tokens=10, logprobs=2)
CURRENT = "4 completions logprobs non-stream"; print("\n== " + CURRENT)
_, d = call("direct", "/v1/completions", body); _, g = call("gateway", "/v1/completions", body)
if d and g:
    cmp("object / id shape", [d["object"], idshape(d["id"])], [g["object"], idshape(g["id"])])
    cmp("text", d["choices"][0]["text"], g["choices"][0]["text"])
    cmp("logprobs (whole object)", d["choices"][0]["logprobs"], g["choices"][0]["logprobs"])
    cmp("finish_reason", d["choices"][0]["finish_reason"], g["choices"][0]["finish_reason"])
    cmp("usage", usage3(d["usage"]), usage3(g["usage"]))
CURRENT = "4 completions logprobs stream"; print("\n== " + CURRENT)
_, d = call("direct", "/v1/completions", dict(body, stream=True, stream_options={"include_usage": True}))
_, g = call("gateway", "/v1/completions", dict(body, stream=True, stream_options={"include_usage": True}))
if d and g:
    dp, df, du, _ = pieces(d, "completions"); gp, gf, gu, _ = pieces(g, "completions")
    cmp("text bytes per chunk", [p[0] for p in dp], [p[0] for p in gp])
    cmp("logprobs bytes per chunk", [p[1] for p in dp], [p[1] for p in gp])
    cmp("finish_reason", df, gf)
    cmp("usage", usage3(du), usage3(gu))

# 5. prefix caching: a different long prompt per side (the cache is shared), each sent 3 times
CURRENT = "5 cached_tokens"; print("\n== " + CURRENT)
words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()
def long_prompt(seed):
    # a nonce first, so a rerun against the same vLLM starts with an empty cache again
    return NONCE + " " + " ".join(words[(i * 7 + seed) % len(words)] + str(i % 10) for i in range(130))
NONCE = "run%d" % (int(time.time()) % 100000)
res = {}
for side, seed in (("direct", 1), ("gateway", 2)):
    b = dict(BASE, messages=[{"role": "user", "content": long_prompt(seed) + " " + side}], max_tokens=4)
    seen = []
    for n in range(2):
        _, ev = call(side, "/v1/chat/completions", dict(b, stream=True, stream_options={"include_usage": True}))
        u = pieces(ev, "chat")[2] if ev else None
        seen.append({"stream#%d" % (n + 1): u and {"prompt_tokens": u["prompt_tokens"], "prompt_tokens_details": u.get("prompt_tokens_details")}})
    _, j = call(side, "/v1/chat/completions", b)
    seen.append({"non-stream#3": j and {"prompt_tokens": j["usage"]["prompt_tokens"], "prompt_tokens_details": j["usage"].get("prompt_tokens_details")}})
    res[side] = seen
# the two prompts differ (so neither side warms the other's cache): compare what is cached
for i in range(3):
    (dk, dv), = res["direct"][i].items(); (gk, gv), = res["gateway"][i].items()
    print("  %s prompt_tokens direct %s / gateway %s (different prompts)" % (dk, dv and dv["prompt_tokens"], gv and gv["prompt_tokens"]))
    cmp("%s cached_tokens" % dk, dv and (dv["prompt_tokens_details"] or {}).get("cached_tokens"), gv and (gv["prompt_tokens_details"] or {}).get("cached_tokens"))
    cmp("%s prompt_tokens_details keys" % dk, dv and sorted(dv["prompt_tokens_details"] or {}), gv and sorted(gv["prompt_tokens_details"] or {}))

# 7. x-request-id
CURRENT = "7 x-request-id"; print("\n== " + CURRENT)
b = dict(BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
rd, d = call("direct", "/v1/chat/completions", b, {"x-request-id": "my-trace-1"})
rg, g = call("gateway", "/v1/chat/completions", b, {"x-request-id": "my-trace-1"})
time.sleep(1)
logged = [l.strip()[:220] for l in open(VLLM_LOG, errors="replace") if "my-trace-1" in l]
print("  direct : response id %s, x-request-id header %r" % (d and d["id"], rd.headers.get("x-request-id")))
print("  gateway: response id %s, x-request-id header %r" % (g and g["id"], rg.headers.get("x-request-id")))
print("  vLLM log lines with my-trace-1:"); [print("    " + l) for l in logged]
cmp("response x-request-id header", rd.headers.get("x-request-id"), rg.headers.get("x-request-id"), "vLLM does not echo")

json.dump({"findings": FINDINGS, "usage": USAGE}, open(os.environ["OUT"], "w"), indent=1)
PYEOF

metric() { curl -s "http://127.0.0.1:$VLLM_PORT/metrics" | awk -v m="$1" '$1 ~ "^"m"({|$)" {s+=$2} END {printf "%d", s}'; }
p0=$(metric vllm:prompt_tokens_total); g0=$(metric vllm:generation_tokens_total)
r0=$(metric vllm:request_success_total)
VLLM_PORT=$VLLM_PORT GW_PORT=$GW_PORT KEY=$KEY MODEL=$MODEL VLLM_LOG=$VLLM_LOG OUT=$WORK/result.json RAW=$WORK/raw "$PY" "$WORK/compare.py"
sleep 2
p1=$(metric vllm:prompt_tokens_total); g1=$(metric vllm:generation_tokens_total)
r1=$(metric vllm:request_success_total)
echo; echo "== 6 usage"
curl -sS "$GW/v1/usage" -H "Authorization: Bearer $KEY"; echo
"$PY" - "$WORK/result.json" "$((p1-p0))" "$((g1-g0))" "$((r1-r0))" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1])); dp, dg, dr = map(int, sys.argv[2:5])
d, g = r["usage"]["direct"], r["usage"]["gateway"]
print("  usage seen by clients  direct:  prompt %d completion %d requests %d" % tuple(d))
print("  usage seen by clients  gateway: prompt %d completion %d requests %d" % tuple(g))
print("  vLLM /metrics deltas:           prompt %d generation %d request_success %d" % (dp, dg, dr))
print("  vLLM delta - direct (= what vLLM did for the gateway): prompt %d completion %d requests %d" % (dp - d[0], dg - d[1], dr - d[2]))
print("\n== differences (%d)" % len(r["findings"]))
for f in r["findings"]:
    print("  [%s] %s\n      direct : %s\n      gateway: %s" % (f[0], f[1], json.dumps(f[2])[:400], json.dumps(f[3])[:400]))
PYEOF
