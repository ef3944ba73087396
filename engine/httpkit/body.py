"""Reading a request body with a size cap (``--max-request-bytes``)."""

from __future__ import annotations

from fastapi import Request

from engine.server.protocol import APIError

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024


def _too_large(limit: int) -> APIError:
    return APIError(
        f"the request body is larger than {limit} bytes (the server's --max-request-bytes)",
        status_code=413,
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 ``APIError`` as soon as it is known to exceed ``limit``
    (by its Content-Length, or while it streams in), without buffering more than that."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
