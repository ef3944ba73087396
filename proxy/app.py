"""The proxy's OpenAI-compatible HTTP front: wiring.

``build_app(cfg)`` returns a Starlette app (``FrontedApp``) whose lifespan owns the shared node clients
(one pooled ``NodeClient`` for requests, one for health checks: ``proxy/node_client.py``), the health
poller and node discovery (registration expiry, DNS names: ``proxy/discovery.py``); the
kit's middlewares (request id, API key, drain) and error handlers; and routes to
``ProxyServing`` (``proxy/serving.py``) and to node registration
(``proxy/registration.py``, authenticated by its own key, not the clients'). A client that
goes away aborts the request on both nodes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.httpkit.auth import OPEN_PATHS, ApiKeyMiddleware
from engine.httpkit.direct import FrontedApp
from engine.httpkit.drain import Drainer, DrainMiddleware
from engine.httpkit.errors import install_error_handlers
from engine.httpkit.request_id import RequestIdMiddleware
from kvconnector.nixl.peers import PeerAllowlist
from proxy.config import ProxyConfig
from proxy.discovery import DiscoveryLoop, Membership
from proxy.dns import (
    MAX_NODES_PER_NAME,
    DnsDiscovery,
    Resolver,
    parse_dns_name,
    system_resolver,
)
from proxy.health import MAX_CALLS_PER_NODE, MAX_HEALTH_BODY_BYTES, HealthChecker
from proxy.legs import Legs
from proxy.metrics import ProxyMetrics
from proxy.node_client import NodeClient
from proxy.nodes import Node, NodePool, Role, not_ready_summary
from proxy.registration import DEREGISTER_PATH, REGISTER_PATH, Registry, serve_registration
from proxy.responses import serve as serve_proxy_responses
from proxy.router import Router
from proxy.serving import ProxyServing
from proxy.validation import CHAT, COMPLETIONS

logger = logging.getLogger(__name__)

WORK_PATHS = frozenset(["/v1/completions", "/v1/chat/completions", "/v1/responses"])


def health_client_connections(cfg: ProxyConfig) -> int:
    """The health client's connections: ``MAX_CALLS_PER_NODE`` per node the proxy may hold
    at once (static, registered, every address each DNS name may list), and some to spare."""
    dns_names = len(cfg.prefill_dns) + len(cfg.decode_dns)
    static = len(cfg.prefill) + len(cfg.decode)
    nodes = static + cfg.max_registered_nodes + dns_names * MAX_NODES_PER_NAME
    return MAX_CALLS_PER_NODE * nodes + 16


def build_app(cfg: ProxyConfig, resolver: Resolver = system_resolver) -> FrontedApp:
    pool = NodePool(cfg.prefill, cfg.decode, cfg.prefill_fallback)
    router = Router.from_config(pool, cfg)
    members = Membership(pool)
    registry = None
    jobs = []
    if cfg.registration_key:
        registry = Registry(
            members,
            cfg.registration_key,
            cfg.registration_ttl,
            cfg.max_registered_nodes,
            allowed=PeerAllowlist.parse(cfg.registration_allowed_nodes),
        )
        jobs.append((registry.run_expiry, min(1.0, cfg.registration_ttl / 4)))
    by_role: dict[Role, tuple[str, ...]] = {"prefill": cfg.prefill_dns, "decode": cfg.decode_dns}
    names = [(role, *parse_dns_name(n)) for role, dns in by_role.items() for n in dns]
    if names:
        jobs.append((DnsDiscovery(members, names, resolver).refresh, cfg.discovery_interval))
    discovery = DiscoveryLoop(jobs)
    metrics = ProxyMetrics(pool, router, members)
    drainer = Drainer(WORK_PATHS, cfg.shutdown_timeout)
    serving = ProxyServing(cfg, pool, router, metrics, drainer)
    node_auth = {"Authorization": f"Bearer {cfg.node_api_key}"} if cfg.node_api_key else {}

    @asynccontextmanager
    async def lifespan(app: FrontedApp) -> AsyncIterator[None]:
        async with (
            NodeClient(
                timeout=cfg.request_timeout,
                connect_timeout=cfg.connect_timeout,
                max_connections=cfg.max_connections,
                headers=node_auth,
            ) as client,
            NodeClient(
                timeout=cfg.health_timeout,
                headers=node_auth,
                max_connections=health_client_connections(cfg),
                max_body_bytes=MAX_HEALTH_BODY_BYTES,
            ) as health_client,
        ):
            health = HealthChecker(pool, health_client, cfg.health_interval)

            def forget(node: Node) -> None:  # its idle connections, in both clients
                client.forget(node.url)
                health_client.forget(node.url)
                health.forget(node)  # and its health calls in flight

            members.on_removed = forget
            serving.legs, serving.client = Legs(client), client
            app.state.legs = serving.legs
            app.state.health = health  # its rounds (tests run them by hand)
            await discovery.run_once()  # DNS names resolved before the first health round
            members.checker = health.check_node  # a node that joins later: checked at once
            health.start()
            discovery.start()
            await health.wait_first_round(cfg.health_timeout + 1.0)
            waiting = not_ready_summary(pool)
            logger.info(
                "proxy up: %d prefill, %d decode node(s); ready: %s%s",
                len(pool.prefill), len(pool.decode), pool.serving,
                f" (not ready: {waiting}; checked every {cfg.health_interval:g} s)" if waiting else "",
            )  # fmt: skip
            try:
                yield
            finally:
                await discovery.stop()
                await members.close()
                await health.stop()
                await serving.legs.drain()

    app = FrontedApp(lifespan=lifespan)
    app.state.pool = pool
    app.state.discovery = discovery  # its jobs (tests run DNS refreshes by hand)
    app.state.metrics = metrics
    app.state.config = cfg
    app.state.drainer = drainer
    install_error_handlers(app)
    # Registration has its own key (checked by its handler), not the clients' --api-key.
    open_paths = OPEN_PATHS | {REGISTER_PATH, DEREGISTER_PATH}
    keys = (cfg.api_key,) if cfg.api_key else ()

    async def completions(request: Request) -> Response:
        return await serving.generate(request, COMPLETIONS)

    async def chat_completions(request: Request) -> Response:
        return await serving.generate(request, CHAT)

    async def responses(request: Request) -> Response:  # as a chat request, translated
        return await serve_proxy_responses(serving, request)

    # Every request passes the kit's middlewares (request id, API key, drain); the
    # generation routes are then served past the router's layers (engine/httpkit/direct.py).
    app.set_front(
        {
            "/v1/completions": completions,
            "/v1/chat/completions": chat_completions,
            "/v1/responses": responses,
        },
        lambda inner: cfg.cors.wrap(
            RequestIdMiddleware(ApiKeyMiddleware(DrainMiddleware(inner, drainer), keys, open_paths))
        ),
    )

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

    @app.post(REGISTER_PATH)
    async def register(request: Request) -> Response:
        return await serve_registration(registry, members, request, REGISTER_PATH)

    @app.post(DEREGISTER_PATH)
    async def deregister(request: Request) -> Response:
        return await serve_registration(registry, members, request, DEREGISTER_PATH)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return serving.models()

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' checks
    async def health() -> JSONResponse:
        return serving.health()

    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's: as /health

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
