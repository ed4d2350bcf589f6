"""Server-sent events (pd/api/sse.py): one JSON object an event, and the end."""

from __future__ import annotations

from pd.api.sse import DONE, sse_event


def test_sse_format():
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"
