"""The HTTP face of one node: OpenAI-compatible endpoints over an ``AsyncLLMEngine``.

The app is thin: it validates requests (``protocol``), tokenizes, streams engine outputs
back as OpenAI objects, detokenizes incrementally and applies stop strings. Scheduling,
sampling and KV transfer live in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.server.metrics import ServerMetrics
from engine.server.protocol import (
    APIError,
    BaseRequest,
    StopStringMatcher,
    check_model,
    check_token_ids,
    error_body,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
    resolve_max_tokens,
)

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
_ROUTES = frozenset(
    ["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/abort", "/health", "/metrics"]
)


@dataclass
class _Step:
    """Text and token ids produced by one engine output (after stop-string handling)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class _Job:
    """One generation request as the HTTP layer sees it."""

    chat: bool
    request_id: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    req: BaseRequest
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    completion_tokens: int = 0

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    @property
    def endpoint(self) -> str:
        return "chat" if self.chat else "completions"

    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt_ids), self.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def choice(
        self, text: str, ids: list[int], finish: str | None, *, stream: bool, first: bool = False
    ) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0}
        if not self.chat:
            c["text"] = text
        elif stream:
            c["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            c["message"] = {"role": "assistant", "content": text}
        c.update(logprobs=None, finish_reason=finish, token_ids=ids)
        return c

    def chunk(self, step: _Step, *, first: bool = False) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self.envelope(
            obj,
            [self.choice(step.text, step.token_ids, step.finish_reason, stream=True, first=first)],
        )
        if self.req.include_usage:
            body["usage"] = None
        if step.kv_transfer_params is not None:
            body["kv_transfer_params"] = step.kv_transfer_params
        return body


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


class _ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _race_disconnect(request: Request, coro: Awaitable[Any]) -> Any:
    """Await ``coro``; if the client goes away first, cancel it and raise _ClientDisconnected."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        watch.cancel()
        raise
    if work in done:
        watch.cancel()
        return work.result()
    work.cancel()
    with contextlib.suppress(BaseException):
        await work
    raise _ClientDisconnected


async def _abort_quietly(engine: Any, request_id: str) -> None:
    try:
        with anyio.CancelScope(shield=True):
            await engine.abort(request_id)
    except Exception:
        logger.warning("abort of request %s failed", request_id, exc_info=True)


async def _generate_steps(engine: Any, job: _Job, detok: Any) -> AsyncIterator[_Step]:
    """Engine outputs -> _Steps; aborts the engine request unless it finished by itself."""
    matcher = StopStringMatcher(job.req.stop)
    finished = False
    # The proxy already streamed the first token it got from the prefill node.
    skip_first = bool((job.req.kv_transfer_params or {}).get("skip_first_token"))
    outputs = engine.generate(
        job.request_id, job.prompt_ids, job.params, kv_transfer_params=job.req.kv_transfer_params
    )
    try:
        async for out in outputs:
            ids = list(out.new_token_ids)
            if ids and job.first_token_at is None:
                job.first_token_at = time.monotonic()
            job.completion_tokens += len(ids)
            if skip_first and ids:
                skip_first = False
                detok.add(ids[:1])  # context for the text of later tokens only
                ids = ids[1:]
            text = detok.add(ids) if ids else ""
            if out.finished:
                text += detok.flush()  # text held back for an incomplete UTF-8 sequence
            text, hit = matcher.feed(text, final=out.finished)
            if hit:
                finished = out.finished
                yield _Step(text, ids, "stop", kv_transfer_params=out.kv_transfer_params)
                return
            if out.finished:
                finished = True
                reason = out.finish_reason or "stop"
                yield _Step(text, ids, reason, out.error, out.kv_transfer_params)
                return
            if text or ids:
                yield _Step(text, ids)
        finished = True
        yield _Step("", [], "error", "engine output stream ended without a final output")
    finally:
        if not finished:
            await _abort_quietly(engine, job.request_id)
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()


def _engine_error(engine: Any, message: str | None) -> APIError:
    if not engine.healthy:
        reason = engine.dead_reason or message or "engine is not running"
        return APIError(
            f"engine unavailable: {reason}",
            status_code=503,
            err_type="server_error",
            code="engine_dead",
        )
    return APIError(message or "internal engine error", status_code=500, err_type="server_error")


class _RequestContextMiddleware:
    """Assigns/echoes X-Request-Id and records HTTP metrics (pure ASGI: streaming-safe)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = ""
        for name, value in scope.get("headers", []):
            if name == b"x-request-id":
                rid = value.decode("latin-1").strip()[:256]
        rid = rid or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        status = 500
        start = time.monotonic()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope["path"] if scope["path"] in _ROUTES else "other"
            self.metrics.observe_http(scope["method"], path, status, time.monotonic() - start)


def build_app(engine: Any) -> FastAPI:
    """The FastAPI app serving ``engine`` (an ``AsyncLLMEngine`` or compatible object)."""
    from engine.tokenizer import IncrementalDetokenizer

    app = FastAPI(title="pdserve node", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(engine)
    app.state.engine = engine
    app.state.metrics = metrics
    started = int(time.time())
    app.add_middleware(_RequestContextMiddleware, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        loc = ".".join(str(p) for p in errs[0].get("loc", ()) if p != "body") if errs else None
        msg = errs[0].get("msg", "invalid request") if errs else "invalid request"
        return JSONResponse(error_body(f"{loc}: {msg}" if loc else msg, param=loc or None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), err_type), status_code=exc.status_code)

    async def read_json(request: Request) -> Any:
        return parse_json_body(await request.body())

    def check_serving() -> None:
        if not engine.healthy:
            raise _engine_error(engine, None)

    def make_job(request: Request, chat: bool, req: BaseRequest, ids: list[int]) -> _Job:
        param = "messages" if chat else "prompt"
        max_tokens = resolve_max_tokens(req.max_tokens, len(ids), engine.max_model_len, param)
        return _Job(
            chat=chat,
            request_id=request.state.request_id,
            model=engine.model_name,
            prompt_ids=ids,
            params=req.sampling_params(max_tokens),
            req=req,
        )

    def finish(job: _Job, reason: str) -> None:
        now = time.monotonic()
        ttft = None if job.first_token_at is None else job.first_token_at - job.arrival
        metrics.observe_finished(
            job.endpoint,
            reason,
            len(job.prompt_ids),
            job.completion_tokens,
            ttft,
            now - job.arrival,
        )
        logger.info(
            "request %s finished: %s, prompt=%d completion=%d tokens, %.3fs",
            job.request_id, reason, len(job.prompt_ids), job.completion_tokens, now - job.arrival,
        )  # fmt: skip

    async def collect(job: _Job, steps: AsyncIterator[_Step]) -> dict[str, Any]:
        texts: list[str] = []
        ids: list[int] = []
        last = _Step("", [], "error", "no output")
        async with contextlib.aclosing(steps):  # type: ignore[type-var]
            async for step in steps:
                texts.append(step.text)
                ids.extend(step.token_ids)
                last = step
                if step.finish_reason is not None:
                    break
        finish(job, last.finish_reason or "error")
        if last.finish_reason == "error":
            raise _engine_error(engine, last.error)
        obj = "chat.completion" if job.chat else "text_completion"
        body = job.envelope(
            obj, [job.choice("".join(texts), ids, last.finish_reason, stream=False)]
        )
        body["usage"] = job.usage()
        if last.kv_transfer_params is not None:
            body["kv_transfer_params"] = last.kv_transfer_params
        return body

    async def sse(job: _Job, first: _Step, steps: AsyncIterator[_Step]) -> AsyncIterator[str]:
        reason = "abort"  # if the client goes away mid-stream
        try:
            if job.chat:
                yield _sse(job.chunk(_Step("", []), first=True))
            step: _Step | None = first
            while step is not None:
                if step.finish_reason == "error":
                    reason = "error"
                    yield _sse(_engine_error(engine, step.error).body())
                    break
                yield _sse(job.chunk(step))
                if step.finish_reason is not None:
                    reason = step.finish_reason
                    break
                step = await anext(steps, None)
            if reason != "error" and job.req.include_usage:
                obj = "chat.completion.chunk" if job.chat else "text_completion"
                usage_chunk = job.envelope(obj, [])
                usage_chunk["usage"] = job.usage()
                yield _sse(usage_chunk)
            yield _SSE_DONE
        except Exception as e:
            logger.exception("request %s failed while streaming", job.request_id)
            reason = "error"
            yield _sse(error_body(f"internal error: {e}", "server_error"))
            yield _SSE_DONE
        finally:
            with anyio.CancelScope(shield=True):
                await steps.aclose()  # type: ignore[attr-defined]
            finish(job, reason)

    async def run_job(request: Request, job: _Job) -> Response:
        logger.info(
            "request %s: %s prompt=%d tokens max_tokens=%d stream=%s",
            job.request_id, job.endpoint, len(job.prompt_ids), job.params.max_tokens,
            job.req.stream,
        )  # fmt: skip
        detok = IncrementalDetokenizer(engine.tokenizer, prompt_ids=job.prompt_ids)
        steps = _generate_steps(engine, job, detok)
        try:
            if not job.req.stream:
                return JSONResponse(await _race_disconnect(request, collect(job, steps)))
            first = await _race_disconnect(request, anext(steps, None))
        except _ClientDisconnected:
            logger.info("request %s: client disconnected, aborted", job.request_id)
            finish(job, "abort")
            return Response(status_code=499)
        if first is None or first.finish_reason == "error":
            await steps.aclose()  # type: ignore[attr-defined]
            finish(job, "error")
            raise _engine_error(engine, first.error if first else None)
        return StreamingResponse(
            sse(job, first, steps),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def guarded(request: Request, handler: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await handler()
        except InvalidRequestError as e:  # raised by the engine, e.g. a duplicate request id
            return JSONResponse(error_body(str(e), param=e.param), status_code=400)
        except APIError as e:
            if e.status_code >= 500:
                logger.warning("request %s: %s", request.state.request_id, e.message)
            return JSONResponse(e.body(), status_code=e.status_code)
        except Exception as e:
            if not engine.healthy:
                err = _engine_error(engine, str(e))
                return JSONResponse(err.body(), status_code=err.status_code)
            logger.exception("request %s failed", request.state.request_id)
            return JSONResponse(error_body(f"internal error: {e}", "server_error"), 500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async def handle() -> Response:
            req = parse_completion_request(await read_json(request))
            check_model(req.model, engine.model_name)
            check_serving()
            if req.prompt_token_ids is not None:
                ids = req.prompt_token_ids
                check_token_ids(ids, getattr(engine, "vocab_size", engine.tokenizer.vocab_size))
            else:
                ids = list(engine.tokenizer.encode(req.prompt_text or ""))
            return await run_job(request, make_job(request, False, req, ids))

        return await guarded(request, handle)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def handle() -> Response:
            req = parse_chat_request(await read_json(request))
            check_model(req.model, engine.model_name)
            check_serving()
            prompt = engine.tokenizer.apply_chat_template(req.messages)
            ids = list(engine.tokenizer.encode(prompt, add_special_tokens=False))
            return await run_job(request, make_job(request, True, req, ids))

        return await guarded(request, handle)

    @app.post("/v1/abort")
    async def abort(request: Request) -> Response:
        async def handle() -> Response:
            body = await read_json(request)
            rid = body.get("request_id") if isinstance(body, dict) else None
            if not isinstance(rid, str) or not rid:
                raise APIError("'request_id' must be a non-empty string", param="request_id")
            logger.info("abort requested for %s", rid)
            await engine.abort(rid)
            return JSONResponse({"request_id": rid, "aborted": True})

        return await guarded(request, handle)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {
            "id": engine.model_name,
            "object": "model",
            "created": started,
            "owned_by": "pdserve",
            "root": engine.model_name,
            "parent": None,
            "max_model_len": engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/v1/kv_transfer_info")
    async def kv_transfer_info() -> JSONResponse:
        """What a proxy needs to pair this node: engine id, side channel, role."""
        return JSONResponse(engine.kv_info() if hasattr(engine, "kv_info") else {})

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.healthy:
            return JSONResponse({"status": "ok"})
        reason = engine.dead_reason or "engine is not running"
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
