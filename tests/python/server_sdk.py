"""The real `openai` package against a Switchyard server, as the company's developers use it.

Usage: server_sdk.py BASE_URL API_KEY MODE
  MODE=normal: streams from each demo model, non-streaming, AuthenticationError for a bad key,
               NotFoundError for an unknown model.
  MODE=crash:  the engines of `small` crash mid-stream: the SDK must raise APIError.
  MODE=quota:  the key's tokens per day are spent: RateLimitError, not retried by the SDK.
Prints one JSON line of what it saw; exits non-zero on any mismatch.
"""
import json
import sys

import openai

base_url, key, mode = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
messages = [{"role": "user", "content": "Say hello in five words."}]
seen = {}

if mode == "normal":
    for model in ["small", "medium", "large"]:
        chunks = list(client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, stream=True,
            stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        last = chunks[-1]
        assert last.choices == [] and last.usage.completion_tokens == 6, last
        seen[model] = {"model": chunks[0].model, "completion_tokens": last.usage.completion_tokens,
                       "chars": len(text)}
    resp = client.chat.completions.create(model="small", messages=messages, max_tokens=4)
    assert resp.usage.completion_tokens == 4 and resp.choices[0].finish_reason == "length"
    seen["non_stream"] = resp.usage.completion_tokens
    try:
        openai.OpenAI(base_url=base_url, api_key="sk-sy-wrong", max_retries=0).chat.completions.create(
            model="small", messages=messages, max_tokens=4)
        raise SystemExit("expected AuthenticationError")
    except openai.AuthenticationError as e:
        seen["bad_key"] = type(e).__name__
    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=4, stream=True)
        raise SystemExit("expected NotFoundError")
    except openai.NotFoundError as e:
        seen["unknown_model"] = type(e).__name__
elif mode == "quota":
    # The key's tokens for the day are spent: RateLimitError, and no automatic retry.
    client = openai.OpenAI(base_url=base_url, api_key=key)  # default max_retries=2
    try:
        client.chat.completions.create(model="small", messages=messages, max_tokens=4)
        raise SystemExit("expected RateLimitError")
    except openai.RateLimitError as e:
        body = e.body if isinstance(e.body, dict) else {}
        seen["quota"] = {"error": type(e).__name__, "code": body.get("code"),
                         "retryable": body.get("retryable"), "reset_at": (body.get("details") or {}).get("reset_at")}
elif mode == "crash":
    got = []
    try:
        for chunk in client.chat.completions.create(model="small", messages=messages, max_tokens=40, stream=True):
            got.append(chunk)
        raise SystemExit("expected APIError mid-stream")
    except openai.APIError as e:
        seen["mid_stream"] = {"error": type(e).__name__, "chunks_before": len(got)}
else:
    raise SystemExit(f"unknown mode {mode}")

print(json.dumps(seen))
