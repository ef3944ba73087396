"""The HTTP face of one node: OpenAI-compatible endpoints over an engine client.

The app is wiring: routes to ``OpenAIServing`` (validation, tokenization, streaming,
incremental detokenization, stop strings), the request-id middleware and error handlers
of the shared kit (``engine.httpkit``), health, models, KV info and metrics. Scheduling,
sampling and KV transfer live in the engine.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.config import DEFAULT_MAX_LOGPROB_ENTRIES
from engine.httpkit.admission import Admission, AdmissionMiddleware
from engine.httpkit.auth import ApiKeyMiddleware
from engine.httpkit.cors import CorsPolicy
from engine.httpkit.direct import FrontedApp
from engine.httpkit.drain import DEFAULT_SHUTDOWN_TIMEOUT_S, Drainer, DrainMiddleware
from engine.httpkit.errors import install_error_handlers
from engine.httpkit.listen import DEFAULT_MAX_REQUEST_BYTES
from engine.httpkit.request_id import RequestIdMiddleware
from engine.responses_api.route import serve_responses
from engine.sampling_params import MAX_LOGPROBS
from engine.server.engine_client import EngineClient
from engine.server.metrics import ServerMetrics
from engine.server.serving import OpenAIServing
from engine.server.tokenize import TokenizeServing

WORK_PATHS = frozenset(["/v1/completions", "/v1/chat/completions", "/v1/responses"])
ROUTES = frozenset(
    [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/models",
        "/v1/abort",
        "/health",
        "/ping",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/version",
    ]
)


def build_app(
    engine: EngineClient,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    api_key: str | None = None,
    max_admitted: int | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    trust_request_chat_template: bool = False,
    log_requests: bool = True,
    sampling_defaults: dict[str, Any] | None = None,
    max_logprobs: int = MAX_LOGPROBS,
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES,
    served_model_names: list[str] | None = None,
    model_root: str | None = None,
    cors: CorsPolicy | None = None,
    prompt_tokens_details: bool = False,
) -> FrontedApp:
    """The app serving ``engine`` (an ``AsyncLLMEngine`` or another EngineClient).
    ``app.state.drainer`` drains it on shutdown (``engine.httpkit.drain``). At
    ``max_admitted`` generation requests in flight (``--max-num-seqs`` +
    ``--max-queued-requests``; ``None``: no bound) the next gets 429
    (``engine.httpkit.admission``). ``tool_call_parser``: "auto" tool choice's parser
    (``--enable-auto-tool-choice --tool-call-parser``; None: off). ``reasoning_parser``:
    chat answers' reasoning as ``reasoning_content`` (``--reasoning-parser``; None: off),
    also told to proxies in ``/v1/kv_transfer_info`` (they do not pre-stream such chat
    answers' first token). ``trust_request_chat_template``: a chat request may bring its
    own template (``--trust-request-chat-template``; else a 400). ``log_requests``: each
    request's start and end logged at INFO (``--disable-log-requests``: DEBUG).
    ``sampling_defaults``: of requests that do not set them (``--generation-config``);
    ``max_logprobs``: the most a request may ask (``--max-logprobs``);
    ``max_logprob_entries``: the most entries a request of several choices may be answered
    (``--max-logprob-entries``);
    ``served_model_names``: every name a request's ``model`` may give (default: the
    engine's ``model_name``), each with a card in ``/v1/models`` whose ``root`` is
    ``model_root`` (vLLM's: the ``--model`` given; default: the engine's name). ``cors``: which browser
    origins may call it (``--allowed-origins`` and vLLM's other CORS flags; None: none).
    ``prompt_tokens_details``: answers' usage has ``prompt_tokens_details.cached_tokens``
    (``--enable-prompt-tokens-details``), also told to proxies in ``/v1/kv_transfer_info``
    (they put the prefill node's count there)."""
    names = served_model_names or [engine.model_name]
    app = FrontedApp()
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(
        engine, metrics, max_request_bytes, tool_call_parser, reasoning_parser,
        trust_request_chat_template, log_requests, sampling_defaults, max_logprobs, names,
        max_logprob_entries, prompt_tokens_details,
    )  # fmt: skip
    tokenize_serving = TokenizeServing(
        engine, max_request_bytes, trust_request_chat_template, names
    )
    drainer = Drainer(WORK_PATHS, shutdown_timeout)
    admission = Admission(WORK_PATHS, max_admitted)
    serving.admission = admission  # a request with several choices holds one per choice
    metrics.track_admission(admission)
    app.state.engine = engine
    app.state.admission = admission
    app.state.metrics = metrics
    app.state.drainer = drainer
    started = int(time.time())

    def observe(method: str, path: str, status: int, seconds: float) -> None:
        metrics.observe_http(method, path if path in ROUTES else "other", status, seconds)

    install_error_handlers(app)

    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completions(request)

    async def responses(request: Request) -> Response:  # as a chat request, translated
        return await serve_responses(request, serving.chat_completions, max_request_bytes)

    # Every request passes the kit's middlewares (request id outermost: ids on every
    # answer; admission inside drain and API key); the generation routes are then
    # served past the router's layers (engine/httpkit/direct.py).
    keys = (api_key,) if api_key else ()
    app.set_front(
        {
            "/v1/completions": completions,
            "/v1/chat/completions": chat_completions,
            "/v1/responses": responses,
        },
        lambda inner: (cors or CorsPolicy()).wrap(
            RequestIdMiddleware(
                ApiKeyMiddleware(
                    DrainMiddleware(AdmissionMiddleware(inner, admission), drainer), keys
                ),
                observe=observe,
            )
        ),
    )

    @app.post("/v1/abort")
    async def abort(request: Request) -> Response:
        return await serving.abort(request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [  # one per served name, as vLLM lists them (the first is what answers say)
            {
                "id": name,
                "object": "model",
                "created": started,
                "owned_by": "pdserve",
                "root": model_root or engine.model_name,
                "parent": None,
                "max_model_len": engine.max_model_len,
            }
            for name in names
        ]
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await tokenize_serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await tokenize_serving.detokenize(request)

    @app.get("/version")
    async def version() -> Response:
        return await tokenize_serving.version()

    digest = getattr(engine.tokenizer, "chat_template_digest", None)
    chat_template = digest() if digest is not None else None

    @app.get("/v1/kv_transfer_info")
    async def kv_transfer_info() -> JSONResponse:
        """What a proxy needs to pair this node: engine id, side channel, role, whether
        its chat answers are parsed for reasoning, which chat template it renders with (a
        digest: P and D must render the same prompt), and whether its usage has
        ``prompt_tokens_details``."""
        info = {
            "reasoning_parser": reasoning_parser,
            "chat_template": chat_template,
            "prompt_tokens_details": prompt_tokens_details,
        }
        return JSONResponse({**engine.kv_info(), **info})

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' checks
    async def health() -> JSONResponse:
        if drainer.draining:
            return JSONResponse({"status": "draining", "in_flight": drainer.in_flight}, 503)
        if engine.healthy:
            return JSONResponse({"status": "ok"})
        reason = engine.dead_reason or "engine is not running"
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    # vLLM's (SageMaker's) health check: GET and POST, answered as /health.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
