"""The proxy's OpenAI-compatible HTTP front.

``build_app(cfg)`` returns a FastAPI app whose lifespan owns the shared node clients
(one pooled ``httpx.AsyncClient`` for requests, one for health checks) and the health
poller. Requests are validated before any node is touched (400), refused at
``--max-inflight`` (429) or when no healthy pair exists (503), then served by a
``Session``. A client that goes away aborts the request on both nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from engine.server.protocol import APIError, error_body
from proxy.config import ProxyConfig
from proxy.health import HealthChecker
from proxy.legs import REQUEST_ID_HEADER, Legs
from proxy.metrics import ProxyMetrics
from proxy.nodes import NodePool
from proxy.router import Router
from proxy.session import PassThrough, Session
from proxy.validation import CHAT, COMPLETIONS, validate_request

logger = logging.getLogger(__name__)

T = TypeVar("T")
_RID_OK = re.compile(r"[^A-Za-z0-9._:\-]")


class _ClientDisconnected(Exception):
    pass


async def _race_disconnect(request: Request, coro: Awaitable[T]) -> T:
    """Await ``coro``; if the client disconnects first, cancel it and raise."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            raise _ClientDisconnected
    return work.result()


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator (runs its cleanup) at the end."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _request_id(request: Request) -> str:
    given = _RID_OK.sub("", request.headers.get(REQUEST_ID_HEADER, ""))[:128]
    return given or uuid.uuid4().hex


def _json_error(err: APIError, rid: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        err.body(), status_code=err.status_code, headers={REQUEST_ID_HEADER: rid, **(headers or {})}
    )


def build_app(cfg: ProxyConfig) -> FastAPI:
    pool = NodePool(cfg.prefill, cfg.decode)
    router = Router(pool)
    metrics = ProxyMetrics(pool)
    inflight = 0

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(
            max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections
        )
        timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)
        async with (
            httpx.AsyncClient(limits=limits, timeout=timeout) as client,
            httpx.AsyncClient(timeout=cfg.health_timeout) as health_client,
        ):
            health = HealthChecker(pool, health_client, cfg.health_interval)
            app.state.legs = Legs(client)
            health.start()
            await health.wait_first_round(cfg.health_timeout + 1.0)
            logger.info(
                "proxy up: %d prefill, %d decode node(s); ready: %s",
                len(pool.prefill), len(pool.decode), pool.serving,
            )  # fmt: skip
            try:
                yield
            finally:
                await health.stop()
                await app.state.legs.drain()

    app = FastAPI(
        title="pdserve proxy", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.pool = pool
    app.state.metrics = metrics
    app.state.config = cfg

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), err_type), status_code=exc.status_code)

    async def generate(request: Request, endpoint: str) -> Response:
        nonlocal inflight
        rid = _request_id(request)
        path = "chat" if endpoint == CHAT else "completions"

        def answer(resp: Response, kind: str | None = None) -> Response:
            metrics.requests.labels(path, str(resp.status_code)).inc()
            if kind is not None:
                metrics.errors.labels(kind).inc()
            return resp

        try:
            limit = cfg.max_model_len or pool.max_model_len()
            req = validate_request(endpoint, await request.body(), pool.model_names(), limit)
        except APIError as e:
            return answer(_json_error(e, rid), "bad_request")
        if inflight >= cfg.max_inflight:
            err = APIError(
                f"the proxy is at its limit of {cfg.max_inflight} requests in flight; retry later",
                status_code=429,
                err_type="rate_limit_error",
                code="too_many_requests",
            )
            return answer(_json_error(err, rid, {"Retry-After": "1"}), "overloaded")
        session = Session(req, rid, cfg, router, request.app.state.legs, metrics)
        inflight += 1
        metrics.inflight.inc()
        streaming = False

        def done() -> None:
            nonlocal inflight
            inflight -= 1
            metrics.inflight.dec()
            session.close()

        try:
            if not req.stream:
                body = await _race_disconnect(request, session.complete())
                return answer(JSONResponse(body, headers={REQUEST_ID_HEADER: rid}))
            await _race_disconnect(request, session.start_stream())
            streaming = True
        except _ClientDisconnected:
            logger.info("request %s: client disconnected; aborted on both nodes", rid)
            return answer(Response(status_code=499), "client_disconnect")
        except PassThrough as e:
            return answer(JSONResponse(e.body, e.status, headers={REQUEST_ID_HEADER: rid}))
        except APIError as e:
            kind = "unavailable" if e.status_code == 503 else "upstream"
            return answer(_json_error(e, rid), kind)
        finally:
            if not streaming:
                done()

        async def body_iter() -> AsyncIterator[str]:
            try:
                async for chunk in session.events():
                    yield chunk
            finally:
                if session.outcome == "pending":
                    metrics.errors.labels("client_disconnect").inc()
                    logger.info("request %s: client disconnected mid-stream; aborted", rid)
                done()

        headers = {REQUEST_ID_HEADER: rid, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return answer(_SSEResponse(body_iter(), media_type="text/event-stream", headers=headers))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards: list[dict[str, Any]] = []
        for name in pool.model_names():
            lens = [n.max_model_len for n in pool.all() if n.model == name and n.max_model_len]
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "pdserve",
                    "root": name,
                    "parent": None,
                    "max_model_len": cfg.max_model_len or (min(lens) if lens else None),
                }
            )
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/health")
    async def health() -> JSONResponse:
        nodes = {
            role: [
                {
                    "url": n.url,
                    "healthy": n.ready,
                    "outstanding": n.outstanding,
                    "error": n.last_error,
                }  # fmt: skip
                for n in pool.nodes(role)
            ]
            for role in ("prefill", "decode")
        }
        if pool.serving:
            return JSONResponse({"status": "ok", **nodes})
        reason = (
            "no healthy prefill node" if not pool.ready("prefill") else "no healthy decode node"
        )
        return JSONResponse({"status": "unavailable", "reason": reason, **nodes}, 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
