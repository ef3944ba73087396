"""Server-sent events: framing, and a response that always runs its generator's cleanup."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(obj: Any) -> str:
    """One ``data:`` event holding ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    """An event stream that closes its generator at the end, also when the client left
    mid-stream (so the generator's ``finally`` — aborts, metrics — always runs), then runs
    ``on_close``: the cleanup of a stream that may never start (a client gone before its
    first byte was sent: the generator's ``finally`` never runs then)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: Any,
        headers: dict[str, str] | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(
            content, media_type=self.media_type, headers={**SSE_HEADERS, **(headers or {})}
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            with anyio.CancelScope(shield=True):
                if aclose is not None:
                    await aclose()
                if self.on_close is not None:
                    await self.on_close()
