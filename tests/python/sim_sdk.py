"""Streams from `switchyard sim` with the real `openai` package, as a developer would.

Usage: sim_sdk.py BASE_URL MODEL   (BASE_URL like http://127.0.0.1:8000/v1)
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

print(json.dumps(seen))
