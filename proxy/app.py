"""The proxy's OpenAI-compatible HTTP front: wiring.

``build_app(cfg)`` returns a FastAPI app whose lifespan owns the shared node clients
(one pooled ``httpx.AsyncClient`` for requests, one for health checks) and the health
poller; the kit's middlewares (request id, API key, drain) and error handlers; and routes
to ``ProxyServing`` (``proxy/serving.py``). A client that goes away aborts the request on
both nodes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.httpkit.auth import ApiKeyMiddleware
from engine.httpkit.drain import Drainer, DrainMiddleware
from engine.httpkit.errors import install_error_handlers
from engine.httpkit.request_id import RequestIdMiddleware
from proxy.config import ProxyConfig
from proxy.health import HealthChecker
from proxy.legs import Legs
from proxy.metrics import ProxyMetrics
from proxy.nodes import NodePool
from proxy.router import Router
from proxy.serving import ProxyServing
from proxy.validation import CHAT, COMPLETIONS

logger = logging.getLogger(__name__)

WORK_PATHS = frozenset(["/v1/completions", "/v1/chat/completions"])


def build_app(cfg: ProxyConfig) -> FastAPI:
    pool = NodePool(cfg.prefill, cfg.decode)
    router = Router.from_config(pool, cfg)
    metrics = ProxyMetrics(pool, router)
    drainer = Drainer(WORK_PATHS, cfg.shutdown_timeout)
    serving = ProxyServing(cfg, pool, router, metrics, drainer)
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
            serving.legs, serving.client = Legs(client), client
            app.state.legs = serving.legs
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
                await serving.legs.drain()

    app = FastAPI(
        title="pdserve proxy", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.pool = pool
    app.state.metrics = metrics
    app.state.config = cfg
    app.state.drainer = drainer
    app.add_middleware(DrainMiddleware, drainer=drainer)
    app.add_middleware(ApiKeyMiddleware, keys=(cfg.api_key,) if cfg.api_key else ())
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.generate(request, COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.generate(request, CHAT)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await serving.forward(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await serving.forward(request, "/detokenize")

    @app.get("/version")
    async def version() -> JSONResponse:
        from engine.server.tokenize import pdserve_version

        return JSONResponse({"version": pdserve_version()})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return serving.models()

    @app.get("/health")
    async def health() -> JSONResponse:
        return serving.health()

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
