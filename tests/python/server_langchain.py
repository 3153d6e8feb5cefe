"""LangChain's `ChatOpenAI` (PyPI `langchain-openai`) against a Switchyard server: a forced tool call.

Usage: server_langchain.py BASE_URL API_KEY
Prints one JSON line of what it saw; exits non-zero on any mismatch.
"""
import json
import sys

try:
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI
except ImportError as e:  # an old venv made before langchain-openai joined it
    raise SystemExit(f"langchain-openai is missing from this venv ({e}); scripts/test installs it")

base_url, key = sys.argv[1], sys.argv[2]

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
            },
            "required": ["city", "days", "unit"],
        },
    },
}

llm = ChatOpenAI(base_url=base_url, api_key=key, model="small", max_retries=0, max_tokens=400,
                 seed=99, timeout=60)
seen = {}
for label, choice in [("named", "get_weather"), ("required", "required")]:
    msg = llm.bind_tools([WEATHER], tool_choice=choice).invoke("What is the weather in Lisbon?")
    if not isinstance(msg, AIMessage):
        raise SystemExit(f"expected an AIMessage, got {type(msg).__name__}: {msg!r}")
    if len(msg.tool_calls) != 1 or msg.invalid_tool_calls:
        raise SystemExit(f"expected one valid tool call: {msg!r}")
    call = msg.tool_calls[0]
    args = call["args"]
    if call["name"] != "get_weather" or not isinstance(args, dict):
        raise SystemExit(f"expected get_weather with a dict of args: {call!r}")
    if not (isinstance(args.get("city"), str) and type(args.get("days")) is int
            and args.get("unit") in ("celsius", "fahrenheit")):
        raise SystemExit(f"args do not match the schema: {args!r}")
    seen[label] = {"name": call["name"], "args": args, "id": call["id"],
                   "finish_reason": msg.response_metadata.get("finish_reason"),
                   "usage": msg.usage_metadata and {"input": msg.usage_metadata["input_tokens"],
                                                    "output": msg.usage_metadata["output_tokens"]}}

# Streamed too: the chunks add up to the same kind of call.
stream = llm.bind_tools([WEATHER], tool_choice="get_weather").stream("What is the weather in Porto?")
full = None
for chunk in stream:
    full = chunk if full is None else full + chunk
if full is None or len(full.tool_calls) != 1 or full.tool_calls[0]["name"] != "get_weather":
    raise SystemExit(f"streamed tool call: {full!r}")
seen["streamed"] = {"name": full.tool_calls[0]["name"], "args": full.tool_calls[0]["args"]}

print(json.dumps(seen))
