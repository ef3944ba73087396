"""Reading a request body with a size cap (``--max-request-bytes``) and a read deadline."""

from __future__ import annotations

import asyncio

from fastapi import Request

from engine.server.protocol import APIError

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
# Longest wait for the next piece of a body (nginx's client_body_timeout is 60 s): a
# client that stops sending mid-body is answered 408, not waited for (slowloris).
BODY_READ_TIMEOUT_S = 30.0


def _too_large(limit: int) -> APIError:
    return APIError(
        f"the request body is larger than {limit} bytes (the server's --max-request-bytes)",
        status_code=413,
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 ``APIError`` as soon as it is known to exceed ``limit``
    (by its Content-Length, or while it streams in), without buffering more than that; a
    408 ``APIError`` when no piece of it arrives for ``BODY_READ_TIMEOUT_S``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    pieces = request.stream()
    while True:
        try:
            async with asyncio.timeout(BODY_READ_TIMEOUT_S):
                chunk = await anext(pieces)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise APIError(
                f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g} s",
                status_code=408,
                code="request_timeout",
            ) from None
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
