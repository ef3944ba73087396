"""Reading a request body with a size cap (``--max-request-bytes``) and read deadlines."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from engine.httpkit.disconnect import ClientDisconnected
from engine.server.request_fields import APIError

# Longest wait for the next piece of a body (nginx's client_body_timeout is 60 s): a
# client that stops sending mid-body is answered 408, not waited for (slowloris).
BODY_READ_TIMEOUT_S = 30.0
# And the whole body: BODY_READ_TIMEOUT_S, plus one second for every this many bytes that
# arrived (Apache's mod_reqtimeout ``body=...,MinRate=500``). A body trickling in a byte at
# a time is cut off after ~BODY_READ_TIMEOUT_S instead of holding an admission slot for
# as long as the size cap lets it; any client sending 500 bytes/s or more is not affected.
MIN_BODY_RATE_BYTES_PER_S = 500.0


def _too_large(limit: int) -> APIError:
    return APIError(
        f"the request body is larger than {limit} bytes (the server's --max-request-bytes)",
        status_code=413,
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 ``APIError`` as soon as it is known to exceed ``limit``
    (by its Content-Length, or while it streams in), without buffering more than that; a
    415 ``APIError`` for a compressed body; a 408 ``APIError`` when no piece of it
    arrives for ``BODY_READ_TIMEOUT_S`` or the body arrives slower than
    ``MIN_BODY_RATE_BYTES_PER_S`` allows; ``ClientDisconnected``
    when the client closes the connection before the body is complete."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(
            f"Content-Encoding {encoding[:64]!r} is not supported: send the body uncompressed",
            status_code=415,
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    pieces = request.stream()
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        # The next piece's wait: the gap deadline, or less if the whole body's is sooner.
        left = start + BODY_READ_TIMEOUT_S + size / MIN_BODY_RATE_BYTES_PER_S - loop.time()
        wait = min(BODY_READ_TIMEOUT_S, left)
        try:
            if wait <= 0:
                raise TimeoutError
            async with asyncio.timeout(wait):
                chunk = await anext(pieces)
        except StopAsyncIteration:
            break
        except ClientDisconnect:
            raise ClientDisconnected from None
        except TimeoutError:
            why = (
                f"did not arrive within {BODY_READ_TIMEOUT_S:g} s"
                if wait == BODY_READ_TIMEOUT_S
                else f"arrived slower than {MIN_BODY_RATE_BYTES_PER_S:g} bytes/s"
            )
            raise APIError(
                f"the request body {why}", status_code=408, code="request_timeout"
            ) from None
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
