"""Streams from `switchyard sim` with the real `openai` package, as a developer would.

Usage: sim_sdk.py BASE_URL MODEL [EMBEDDING_MODEL]   (BASE_URL like http://127.0.0.1:8000/v1)
Prints one JSON line of what it saw; exits non-zero on any mismatch.
"""
import json
import sys

import openai

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
messages = [{"role": "user", "content": "Say hello in five words."}]
seen = {}

# Streaming without usage: content arrives in chunks, no usage anywhere.
text, finish, usage = "", None, None
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=12, stream=True):
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
assert finish == "length", finish
assert usage is None, usage
assert text, "no text streamed"
seen["stream_no_usage"] = {"finish_reason": finish, "chars": len(text)}

# Streaming with usage: the last chunk has no choices and carries the exact usage.
chunks = list(client.chat.completions.create(
    model=model, messages=messages, max_tokens=12, stream=True, stream_options={"include_usage": True}))
last = chunks[-1]
assert last.choices == [], last
assert last.usage.completion_tokens == 12, last.usage
assert last.usage.prompt_tokens == 18, last.usage
assert all(c.usage is None for c in chunks[:-1])
seen["stream_usage"] = {"prompt_tokens": last.usage.prompt_tokens, "completion_tokens": last.usage.completion_tokens}

# Non-streaming.
resp = client.chat.completions.create(model=model, messages=messages, max_tokens=7, seed=3)
assert resp.usage.completion_tokens == 7 and resp.choices[0].finish_reason == "length", resp
seen["non_stream"] = {"completion_tokens": resp.usage.completion_tokens}

# Unknown model: NotFoundError, with vLLM's message.
try:
    client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=5, stream=True)
    raise SystemExit("expected NotFoundError")
except openai.NotFoundError as e:
    assert e.status_code == 404
    seen["unknown_model"] = type(e).__name__

# A forced tool call, streamed: the SDK sees one call whose arguments parse.
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["unit", "days"]}}}]
args, name, finish = "", None, None
for chunk in client.chat.completions.create(
        model=model, messages=messages, tools=tools, max_tokens=100, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}):
    for choice in chunk.choices:
        for call in choice.delta.tool_calls or []:
            name = call.function.name or name
            args += call.function.arguments or ""
        finish = choice.finish_reason or finish
parsed = json.loads(args)
assert name == "get_weather" and parsed["unit"] in ("celsius", "fahrenheit") and 1 <= parsed["days"] <= 7, args
assert finish == "stop", finish
resp = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="required", max_tokens=100)
assert resp.choices[0].finish_reason == "tool_calls", resp
json.loads(resp.choices[0].message.tool_calls[0].function.arguments)
seen["tool_call"] = {"name": name, "finish_reason": finish}

# Logprobs: the sampled token first in top_logprobs.
resp = client.chat.completions.create(model=model, messages=messages, max_tokens=4, logprobs=True, top_logprobs=3, seed=5)
content = resp.choices[0].logprobs.content
assert len(content) == 4 and all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)
assert all(t.logprob <= 0 for t in content)
seen["logprobs"] = len(content)

# Legacy completions, streamed with usage and not.
comp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, logprobs=2)
assert comp.usage.prompt_tokens == 6 and comp.usage.completion_tokens == 6, comp.usage
assert len(comp.choices[0].logprobs.tokens) == 6
chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, stream=True,
                                        stream_options={"include_usage": True}))
assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
seen["completions"] = {"prompt_tokens": comp.usage.prompt_tokens, "chunks": len(chunks)}

# Embeddings (the SDK asks for base64 by default and decodes it).
if len(sys.argv) > 3:
    emb = client.embeddings.create(model=sys.argv[3], input=["Hello world", "The quick brown fox"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 256, emb
    assert abs(sum(x * x for x in emb.data[0].embedding) - 1) < 1e-3
    assert emb.usage.prompt_tokens == 14, emb.usage
    floats = client.embeddings.create(model=sys.argv[3], input="Hello world", encoding_format="float")
    assert all(abs(a - b) < 1e-6 for a, b in zip(floats.data[0].embedding, emb.data[0].embedding))
    seen["embeddings"] = {"n": len(emb.data), "prompt_tokens": emb.usage.prompt_tokens}

print(json.dumps(seen))
