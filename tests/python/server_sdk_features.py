"""The real `openai` package against a Switchyard server: tool calls, logprobs, legacy completions,
embeddings and model lookups, and the same seeded requests straight to an engine to compare.

Usage: server_sdk_features.py BASE_URL API_KEY MODE [ENGINE_BASE_URL ENGINE_MODEL]
  MODE=features: everything below against the gateway (model `small`, embeddings `embed`), and the
                 seeded tool-call and logprobs requests again against the engine ENGINE_BASE_URL
                 (a simulator of `small`, served as ENGINE_MODEL): the gateway must relay exactly
                 what the engine produced.
  MODE=billing:  one tool-call stream and one logprobs stream with usage; prints their ids (the
                 completion id is the ledger row's request id) and the usage the client saw.
Prints one JSON line of what it saw; exits non-zero on any mismatch.
"""
import base64
import json
import struct
import sys

import openai

base_url, key, mode = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
seen = {}

# A function with a few typed parameters; the engine's structured output must satisfy it.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "detailed": {"type": "boolean"},
            },
            "required": ["city", "days", "unit", "detailed"],
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                           "label": {"type": "string"}},
            "required": ["hour", "label"],
        },
    },
}
TOOLS = [WEATHER, ALARM]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Lisbon for the next three days?"}]
SEED = 1234


def check(cond, what):
    if not cond:
        raise SystemExit(f"mismatch: {what}")


def check_arguments(name, arguments):
    """The arguments parse as a JSON object with the function's required keys, typed."""
    args = json.loads(arguments)
    check(isinstance(args, dict), f"arguments of {name} are an object: {arguments!r}")
    if name == "get_weather":
        check(isinstance(args.get("city"), str), f"city is a string: {args}")
        check(type(args.get("days")) is int and 1 <= args["days"] <= 7, f"days in 1..7: {args}")
        check(args.get("unit") in ("celsius", "fahrenheit"), f"unit in the enum: {args}")
        check(type(args.get("detailed")) is bool, f"detailed is a boolean: {args}")
    elif name == "set_alarm":
        check(type(args.get("hour")) is int and 0 <= args["hour"] <= 23, f"hour in 0..23: {args}")
        check(isinstance(args.get("label"), str), f"label is a string: {args}")
    else:
        raise SystemExit(f"unexpected function {name!r}")
    return args


def stream_tool_call(c, model, tool_choice):
    """Streams a forced call with usage; assembles it from the deltas as an SDK user does."""
    chunks = list(c.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, seed=SEED,
        max_tokens=400, stream=True, stream_options={"include_usage": True}))
    calls, finish = {}, None
    for ch in chunks:
        for choice in ch.choices:
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    call["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            if choice.finish_reason:
                finish = choice.finish_reason
    check(len(calls) == 1 and 0 in calls, f"one tool call at index 0: {calls}")
    call = calls[0]
    check(call["id"] and call["id"].startswith("chatcmpl-tool-"), f"a vLLM tool call id: {call}")
    last = chunks[-1]
    check(last.choices == [] and last.usage is not None, f"the last chunk is the usage chunk: {last}")
    check(last.usage.completion_tokens > 0 and last.usage.prompt_tokens > 0, f"usage counted: {last.usage}")
    check(all(ch.usage is None for ch in chunks[:-1]), "usage only in the last chunk")
    check(len({ch.id for ch in chunks}) == 1, "one id for every chunk")
    return {"name": call["name"], "arguments": call["arguments"], "finish_reason": finish,
            "usage": [last.usage.prompt_tokens, last.usage.completion_tokens],
            "id": chunks[0].id}


def plain_tool_call(c, model, tool_choice):
    resp = c.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                     tool_choice=tool_choice, seed=SEED, max_tokens=400)
    choice = resp.choices[0]
    calls = choice.message.tool_calls or []
    check(len(calls) == 1 and calls[0].type == "function", f"one function call: {choice.message}")
    return {"name": calls[0].function.name, "arguments": calls[0].function.arguments,
            "finish_reason": choice.finish_reason,
            "usage": [resp.usage.prompt_tokens, resp.usage.completion_tokens]}


def stream_logprobs(c, model):
    chunks = list(c.chat.completions.create(
        model=model, messages=MESSAGES, logprobs=True, top_logprobs=2, seed=SEED, max_tokens=16,
        stream=True, stream_options={"include_usage": True}))
    text, entries = "", []
    for ch in chunks:
        for choice in ch.choices:
            text += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                entries += choice.logprobs.content
    usage = chunks[-1].usage
    check(usage is not None and chunks[-1].choices == [], "the last chunk is the usage chunk")
    check_logprobs(entries, text, usage.completion_tokens)
    return {"text": text, "tokens": [e.token for e in entries],
            "logprobs": [e.logprob for e in entries],
            "usage": [usage.prompt_tokens, usage.completion_tokens],
            "id": chunks[0].id}


def check_logprobs(entries, text, completion_tokens):
    check(len(entries) == completion_tokens, f"{len(entries)} logprob entries for {completion_tokens} tokens")
    for e in entries:
        check(e.logprob <= 0, f"logprob <= 0: {e}")
        check(len(e.top_logprobs) == 2, f"2 top entries: {e}")
        check(all(t.logprob <= 0 for t in e.top_logprobs), f"top logprobs <= 0: {e}")
    check("".join(e.token for e in entries) == text,
          f"tokens joined {''.join(e.token for e in entries)!r} equal the text {text!r}")


if mode == "features":
    engine_base, engine_model = sys.argv[4], sys.argv[5]
    engine = openai.OpenAI(base_url=engine_base, api_key="unused", max_retries=0)

    # Forced tool calls, streamed and not, named (vLLM finishes with "stop") and "required"
    # (vLLM finishes with "tool_calls").
    tools = {}
    for label, choice in [("named", NAMED), ("required", "required")]:
        streamed = stream_tool_call(client, "small", choice)
        plain = plain_tool_call(client, "small", choice)
        direct = stream_tool_call(engine, engine_model, choice)
        direct_again = stream_tool_call(engine, engine_model, choice)
        for got in (streamed, plain, direct):
            check_arguments(got["name"], got["arguments"])
        check(streamed["name"] == "get_weather" or label == "required", f"the named function: {streamed}")
        # The engine is deterministic under a seed, and the gateway relays exactly what it made.
        check((direct["name"], direct["arguments"], direct["usage"])
              == (direct_again["name"], direct_again["arguments"], direct_again["usage"]),
              f"the engine repeats itself under a seed: {direct} vs {direct_again}")
        for what in ("name", "arguments", "finish_reason", "usage"):
            check(streamed[what] == direct[what], f"{label} stream {what}: gateway {streamed} engine {direct}")
        check(json.loads(plain["arguments"]) == json.loads(direct["arguments"]),
              f"{label} non-streamed arguments: gateway {plain} engine {direct}")
        check(plain["name"] == direct["name"] and plain["usage"] == direct["usage"],
              f"{label} non-streamed call: gateway {plain} engine {direct}")
        tools[label] = {"name": streamed["name"], "args": json.loads(streamed["arguments"]),
                        "finish_stream": streamed["finish_reason"], "finish_plain": plain["finish_reason"],
                        "usage": streamed["usage"]}
    seen["tools"] = tools

    # Logprobs, streamed and not, compared with the engine's own answer to the same seed.
    streamed = stream_logprobs(client, "small")
    direct = stream_logprobs(engine, engine_model)
    for what in ("text", "tokens", "logprobs", "usage"):
        check(streamed[what] == direct[what], f"logprobs stream {what}: gateway {streamed} engine {direct}")
    resp = client.chat.completions.create(model="small", messages=MESSAGES, logprobs=True, top_logprobs=2,
                                          seed=SEED, max_tokens=16)
    check_logprobs(resp.choices[0].logprobs.content, resp.choices[0].message.content,
                   resp.usage.completion_tokens)
    check(resp.choices[0].message.content == streamed["text"], "the same seed gives the same text")
    seen["logprobs"] = {"tokens": len(streamed["tokens"]), "text": streamed["text"]}

    # Legacy completions, streamed with usage and not.
    chunks = list(client.completions.create(model="small", prompt="Once upon a time", max_tokens=8,
                                            seed=SEED, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    last = chunks[-1]
    check(last.choices == [] and last.usage.completion_tokens == 8 and last.usage.prompt_tokens > 0,
          f"completions usage chunk: {last}")
    check(any(c.choices and c.choices[0].finish_reason == "length" for c in chunks), "finish_reason length")
    check(chunks[0].object == "text_completion", f"text_completion chunks: {chunks[0]}")
    resp = client.completions.create(model="small", prompt="Once upon a time", max_tokens=8, seed=SEED)
    check(resp.choices[0].text == text, f"same seed, same text: {resp.choices[0].text!r} vs {text!r}")
    check(resp.usage.completion_tokens == 8 and resp.choices[0].finish_reason == "length", f"{resp}")
    seen["completions"] = {"text": text, "usage": [last.usage.prompt_tokens, last.usage.completion_tokens]}

    # Embeddings: floats, explicit base64 (returned as the string: decode it), and the SDK's
    # default (it asks for base64 itself and decodes it into floats).
    floats = client.embeddings.create(model="embed", input=["a", "b", "c"], encoding_format="float")
    vectors = [d.embedding for d in floats.data]
    check(len(vectors) == 3 and [d.index for d in floats.data] == [0, 1, 2], f"3 embeddings: {floats.data}")
    dim = len(vectors[0])
    check(dim > 0 and all(len(v) == dim for v in vectors), "vectors of equal length")
    check(all(isinstance(x, float) for v in vectors for x in v), "float vectors")
    check(floats.usage.prompt_tokens > 0, f"usage.prompt_tokens > 0: {floats.usage}")
    b64 = client.embeddings.create(model="embed", input=["a", "b", "c"], encoding_format="base64")
    decoded = []
    for d in b64.data:
        raw = base64.b64decode(d.embedding)
        decoded.append(list(struct.unpack(f"<{len(raw) // 4}f", raw)))
    sdk_default = [d.embedding for d in client.embeddings.create(model="embed", input=["a", "b", "c"]).data]
    for got in (decoded, sdk_default):
        check(len(got) == 3 and all(len(v) == dim for v in got), "base64 vectors of the same length")
        check(all(abs(x - y) <= 1e-6 * max(1.0, abs(y)) for v, w in zip(got, vectors) for x, y in zip(v, w)),
              "base64 decodes to the float answer")
    seen["embeddings"] = {"count": len(vectors), "dim": dim, "prompt_tokens": floats.usage.prompt_tokens}

    # Models.
    model = client.models.retrieve("small")
    check(model.id == "small" and model.object == "model", f"models.retrieve: {model}")
    try:
        client.models.retrieve("nope")
        raise SystemExit("expected NotFoundError")
    except openai.NotFoundError as e:
        seen["models"] = {"small": model.id, "nope": type(e).__name__}
elif mode == "billing":
    seen["tool_call"] = stream_tool_call(client, "small", NAMED)
    seen["logprobs"] = stream_logprobs(client, "small")
else:
    raise SystemExit(f"unknown mode {mode}")

print(json.dumps(seen))
