"""The HTTP endpoints: OpenAI chat and completions, /tokenize, the prefill engine's /prefill; the request
checks (protocol) and server-sent events (sse)."""
