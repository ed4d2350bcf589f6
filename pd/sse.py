"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n`, closed by `data: [DONE]\\n\\n`."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
