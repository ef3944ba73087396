"""Admission: a bound on the generation requests a server holds at once.

``AdmissionMiddleware`` counts each request on the work paths from its arrival to the
last byte of its answer: while its body is read, parsed and tokenized, while it waits in
the scheduler, runs, waits for its KV, and while its stream is written. Past ``limit``
the next one is answered at once, before its body is read, with 429, ``Retry-After`` and
an OpenAI error body (``type: rate_limit_error``, ``code: overloaded``): a flood of
requests costs neither memory nor engine time, and what was admitted runs as before.

429, not 503: the server is healthy and busy; 503 says it cannot serve (draining, engine
dead), which proxies and load balancers (ours, Envoy's outlier detection) answer by taking
it out of rotation. Both are retried by the OpenAI clients, which honour ``Retry-After``.
Pure ASGI, so streams pass through untouched.
"""

from __future__ import annotations

import json
import logging
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.server.request_fields import error_body

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
OVERLOADED_CODE = "overloaded"
LOG_EVERY_S = 10.0  # refusals are summed into one warning per interval


def overloaded_body(limit: int) -> dict:
    return error_body(
        f"the server is at its limit of {limit} requests in flight; retry later",
        "rate_limit_error",
        code=OVERLOADED_CODE,
    )


class Admission:
    """The count of admitted requests and the limit (``None``: no limit)."""

    def __init__(
        self,
        work_paths: frozenset[str],
        limit: int | None,
        retry_after_s: int = RETRY_AFTER_S,
    ) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self.work_paths = work_paths
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.refused_total = 0
        self._unlogged = 0
        self._logged_at = float("-inf")

    def try_enter(self, count: int = 1) -> bool:
        """Admit ``count`` requests (True) or count a refusal (False): a request with
        several choices (``n``, a batch) holds one more per choice past its first."""
        if self.limit is None or self.in_flight + count <= self.limit:
            self.in_flight += count
            return True
        self.refused_total += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            logger.warning(
                "overloaded: %d request(s) in flight (the limit); refused %d with 429 "
                "since the last report",
                self.in_flight, self._unlogged,
            )  # fmt: skip
            self._logged_at, self._unlogged = now, 0
        return False

    def leave(self, count: int = 1) -> None:
        self.in_flight -= count


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        a = self.admission
        if scope["type"] != "http" or scope["path"] not in a.work_paths:
            await self.app(scope, receive, send)
            return
        if not a.try_enter():
            await _refuse(send, a)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            a.leave()


async def _refuse(send: Send, a: Admission) -> None:
    assert a.limit is not None
    headers = [
        (b"content-type", b"application/json"),
        (b"retry-after", str(a.retry_after_s).encode()),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    body = json.dumps(overloaded_body(a.limit)).encode()
    await send({"type": "http.response.body", "body": body})
