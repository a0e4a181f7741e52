"""Server-sent events as OpenAI's streaming endpoints send them.

Each chunk is one ``data: <json>`` event; the stream ends with ``data: [DONE]``. A failure
after the first chunk (the status is sent by then) is an ``{"error": ...}`` event before
``[DONE]``.
"""
from __future__ import annotations

import json
from typing import Any

MEDIA_TYPE = "text/event-stream"
DONE = "data: [DONE]\n\n"
# proxies (nginx) buffer responses unless told not to; a stream must reach the client token by token
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: Any) -> str:
    """One ``data:`` event holding ``obj`` as compact JSON (one line: JSON escapes newlines)."""
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"
