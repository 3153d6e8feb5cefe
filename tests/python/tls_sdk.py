"""The real `openai` package against a Switchyard server that terminates TLS itself.

Usage: tls_sdk.py BASE_URL API_KEY CA_FILE
  BASE_URL is https://…/v1; CA_FILE is the PEM of the CA that signed the server's certificate.
Streams and posts through the SDK's own HTTP client class (DefaultHttpxClient) trusting
CA_FILE; checks that the SDK's default
trust store refuses the same server, and which ALPN protocol the server picks.
Prints one JSON line of what it saw; exits non-zero on any mismatch.
"""
import json
import socket
import ssl
import sys
from urllib.parse import urlsplit

import openai

base_url, key, ca_file = sys.argv[1], sys.argv[2], sys.argv[3]
context = ssl.create_default_context(cafile=ca_file)
client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0,
                       http_client=openai.DefaultHttpxClient(verify=context))
messages = [{"role": "user", "content": "Say hello over TLS."}]
seen = {}

chunks = list(client.chat.completions.create(
    model="small", messages=messages, max_tokens=5, stream=True,
    stream_options={"include_usage": True}))
assert chunks and chunks[-1].choices == [], chunks[-1]
seen["model"] = chunks[0].model
seen["stream_completion_tokens"] = chunks[-1].usage.completion_tokens

resp = client.chat.completions.create(model="small", messages=messages, max_tokens=3)
seen["completion_tokens"] = resp.usage.completion_tokens

try:
    openai.OpenAI(base_url=base_url, api_key=key, max_retries=0).models.list()
    raise SystemExit("expected APIConnectionError from the default trust store")
except openai.APIConnectionError as e:
    seen["untrusted"] = type(e).__name__

url = urlsplit(base_url)
alpn = ssl.create_default_context(cafile=ca_file)
alpn.set_alpn_protocols(["h2", "http/1.1"])
with socket.create_connection((url.hostname, url.port), timeout=5) as raw:
    with alpn.wrap_socket(raw, server_hostname=url.hostname) as tls:
        seen["alpn"] = tls.selected_alpn_protocol()

print(json.dumps(seen))
