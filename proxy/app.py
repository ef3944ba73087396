"""The proxy's OpenAI-compatible HTTP front.

``build_app(cfg)`` returns a FastAPI app whose lifespan owns the shared node clients
(one pooled ``httpx.AsyncClient`` for requests, one for health checks) and the health
poller. Requests are validated before any node is touched (400), refused at
``--max-inflight`` (429) or when no healthy pair exists (503), then served by a
``Session``. A client that goes away aborts the request on both nodes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.httpkit.auth import ApiKeyMiddleware
from engine.httpkit.body import read_body
from engine.httpkit.disconnect import ClientDisconnected, race_disconnect
from engine.httpkit.drain import Drainer, DrainMiddleware
from engine.httpkit.errors import install_error_handlers, json_error
from engine.httpkit.request_id import RequestIdMiddleware
from engine.httpkit.sse import SSEResponse
from engine.server.protocol import APIError
from proxy.config import ProxyConfig
from proxy.health import HealthChecker
from proxy.legs import Legs
from proxy.metrics import ProxyMetrics
from proxy.nodes import NodePool
from proxy.router import Router
from proxy.session import PassThrough, Session
from proxy.validation import CHAT, COMPLETIONS, validate_request

logger = logging.getLogger(__name__)


def build_app(cfg: ProxyConfig) -> FastAPI:
    pool = NodePool(cfg.prefill, cfg.decode)
    router = Router(pool)
    metrics = ProxyMetrics(pool)
    inflight = 0

    node_auth = {"Authorization": f"Bearer {cfg.node_api_key}"} if cfg.node_api_key else {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(
            max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections
        )
        timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)
        async with (
            httpx.AsyncClient(limits=limits, timeout=timeout, headers=node_auth) as client,
            httpx.AsyncClient(timeout=cfg.health_timeout, headers=node_auth) as health_client,
        ):
            health = HealthChecker(pool, health_client, cfg.health_interval)
            app.state.legs = Legs(client)
            app.state.client = client
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
    drainer = Drainer(frozenset(["/v1/completions", "/v1/chat/completions"]), cfg.shutdown_timeout)
    app.state.drainer = drainer
    app.add_middleware(DrainMiddleware, drainer=drainer)
    app.add_middleware(ApiKeyMiddleware, keys=(cfg.api_key,) if cfg.api_key else ())
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app)

    async def generate(request: Request, endpoint: str) -> Response:
        nonlocal inflight
        rid = request.state.request_id
        path = "chat" if endpoint == CHAT else "completions"

        def answer(resp: Response, kind: str | None = None) -> Response:
            metrics.requests.labels(path, str(resp.status_code)).inc()
            if kind is not None:
                metrics.errors.labels(kind).inc()
            return resp

        try:
            limit = cfg.max_model_len or pool.max_model_len()
            raw = await read_body(request, cfg.max_request_bytes)
            # Off the event loop: a huge body must not stall the other clients' streams.
            req = await anyio.to_thread.run_sync(
                validate_request, endpoint, raw, pool.model_names(), limit
            )
        except APIError as e:
            return answer(json_error(e), "bad_request")
        if inflight >= cfg.max_inflight:
            err = APIError(
                f"the proxy is at its limit of {cfg.max_inflight} requests in flight; retry later",
                status_code=429,
                err_type="rate_limit_error",
                code="too_many_requests",
            )
            return answer(json_error(err, {"Retry-After": "1"}), "overloaded")
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
                body = await race_disconnect(request, session.complete())
                return answer(JSONResponse(body))
            await race_disconnect(request, session.start_stream())
            streaming = True
        except ClientDisconnected:
            logger.info("request %s: client disconnected; aborted on both nodes", rid)
            return answer(Response(status_code=499), "client_disconnect")
        except PassThrough as e:
            return answer(JSONResponse(e.body, e.status))
        except APIError as e:
            kind = "unavailable" if e.status_code == 503 else "upstream"
            return answer(json_error(e), kind)
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

        return answer(SSEResponse(body_iter()))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT)

    async def forward(request: Request, path: str) -> Response:
        """A node utility endpoint (``/tokenize``, ``/detokenize``): the body as it came, to
        one healthy node (decode first; every node serves the same model), its answer back."""
        raw = await read_body(request, cfg.max_request_bytes)
        nodes = [n for role in ("decode", "prefill") for n in pool.nodes(role) if n.ready]
        if not nodes:
            err = APIError(
                "no healthy node to answer", status_code=503, err_type="server_error",
                code="no_healthy_node",
            )  # fmt: skip
            return json_error(err)
        node = nodes[0]
        try:
            resp = await request.app.state.client.post(
                node.url + path, content=raw, headers={"Content-Type": "application/json"}
            )
        except httpx.HTTPError as e:
            err = APIError(
                f"node {node.url} did not answer {path}: {e!r}", status_code=502,
                err_type="server_error", code="upstream_error",
            )  # fmt: skip
            return json_error(err)
        media = resp.headers.get("content-type", "application/json")
        return Response(resp.content, status_code=resp.status_code, media_type=media)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await forward(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await forward(request, "/detokenize")

    @app.get("/version")
    async def version() -> JSONResponse:
        from engine.server.tokenize import pdserve_version

        return JSONResponse({"version": pdserve_version()})

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
        if drainer.draining:
            return JSONResponse({"status": "draining", "in_flight": drainer.in_flight}, 503)
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
