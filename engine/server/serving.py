"""The node's OpenAI handlers: a request becomes a ``Job``, its steps a response or a stream."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.httpkit.body import read_body
from engine.httpkit.disconnect import ClientDisconnected, race_disconnect
from engine.httpkit.errors import json_error
from engine.httpkit.listen import DEFAULT_MAX_REQUEST_BYTES
from engine.httpkit.sse import SSE_DONE, SSEResponse, sse_event
from engine.outputs import Logprobs
from engine.sampling_params import InvalidRequestError
from engine.server.engine_client import EngineClient
from engine.server.jobs import Job, Step, engine_error, generate_steps
from engine.server.logprobs import TokenStrings
from engine.server.metrics import ServerMetrics
from engine.server.protocol import (
    APIError,
    BaseRequest,
    CompletionRequest,
    check_model,
    check_token_ids,
    error_body,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
    resolve_max_tokens,
)
from engine.server.tokenize import render_chat

logger = logging.getLogger(__name__)

# The engine's id of a request (the key ``/v1/abort`` takes), on every generation response.
ENGINE_ID_HEADER = "X-PDServe-Request-Id"


def _shown(value: str, limit: int = 128) -> str:
    """A client's string for the log: quoted and escaped (no forged lines), bounded."""
    return repr(value[:limit]) + (f" (+{len(value) - limit} chars)" if len(value) > limit else "")


def _field_names(names: tuple[str, ...], limit: int = 20) -> str:
    """The ignored field names for the log, bounded (a client picks them)."""
    shown = ", ".join(repr(n[:64]) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def engine_request_id(label: str) -> str:
    """A fresh engine id for a request the client labelled ``label`` (its ``X-Request-Id``):
    unique per request, so a client reusing a label never touches another's request."""
    return f"{label}-{uuid.uuid4().hex[:12]}"


class OpenAIServing:
    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        self._strings: TokenStrings | None = None  # token names for logprobs, made once

    @property
    def strings(self) -> TokenStrings:
        if self._strings is None:
            self._strings = TokenStrings(self.engine.tokenizer)
        return self._strings

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.max_request_bytes)

    # -- endpoints ----------------------------------------------------------------------------
    # Parsing, validation and tokenization run in a worker thread: a huge body (a long token
    # list, a long text) must not hold the event loop that serves every other client.
    async def completions(self, request: Request) -> Response:
        async def handle() -> Response:
            raw = await self._body(request)
            req, ids = await anyio.to_thread.run_sync(self._prepare_completion, raw)
            return await self._run(request, self._job(request, False, req, ids))

        return await self._guarded(request, handle)

    async def chat_completions(self, request: Request) -> Response:
        async def handle() -> Response:
            raw = await self._body(request)
            req, ids = await anyio.to_thread.run_sync(self._prepare_chat, raw)
            return await self._run(request, self._job(request, True, req, ids))

        return await self._guarded(request, handle)

    async def abort(self, request: Request) -> Response:
        """``{"request_id": id}``: the request whose engine id (``X-PDServe-Request-Id``) is
        ``id``, else every request labelled ``id`` (its ``X-Request-Id``);
        ``{"transfer_id": id}``: every request of that transfer (the proxy's legs)."""

        async def handle() -> Response:
            body = parse_json_body(await self._body(request))
            body = body if isinstance(body, dict) else {}
            by = "transfer_id" if "transfer_id" in body else "request_id"
            key = body.get(by)
            if not isinstance(key, str) or not key:
                raise APIError(f"'{by}' must be a non-empty string", param=by)
            ids = await self.engine.abort_matching(key, by)
            logger.info(
                "abort requested for %s (%s): %s", _shown(key), by, ", ".join(ids) or "none"
            )
            return JSONResponse({by: key, "aborted": True, "request_ids": ids})

        return await self._guarded(request, handle)

    def _prepare_completion(self, raw: bytes) -> tuple[BaseRequest, list[int]]:
        req = parse_completion_request(parse_json_body(raw))
        self._check_serving(req)
        if req.prompt_token_ids is not None:
            check_token_ids(req.prompt_token_ids, self.engine.vocab_size)
            if req.echo:  # the text echoed before the answer
                req.prompt_text = self.engine.tokenizer.decode(req.prompt_token_ids)
            return req, req.prompt_token_ids
        return req, list(self.engine.tokenizer.encode(req.prompt_text or ""))

    def _prepare_chat(self, raw: bytes) -> tuple[BaseRequest, list[int]]:
        req = parse_chat_request(parse_json_body(raw))
        self._check_serving(req)
        tok = self.engine.tokenizer
        return req, list(
            tok.encode(
                render_chat(tok, req.messages, req.chat_template_kwargs), add_special_tokens=False
            )
        )

    # -- one job ------------------------------------------------------------------------------
    def _check_serving(self, req: BaseRequest) -> None:
        check_model(req.model, self.engine.model_name)
        check_token_ids(list(req.logit_bias), self.engine.vocab_size, "logit_bias")
        if not self.engine.healthy:
            raise engine_error(self.engine, None)

    def _job(self, request: Request, chat: bool, req: BaseRequest, ids: list[int]) -> Job:
        param = "messages" if chat else "prompt"
        kv = req.kv_transfer_params
        if kv is not None and kv.do_remote_decode:
            # A prefill leg computes the prompt and one token: this node's context bounds
            # the prompt; the answer's budget is the decode node's to check.
            resolve_max_tokens(1, len(ids), self.engine.max_model_len, param)
            max_tokens = req.max_tokens or 1
        else:
            max_tokens = resolve_max_tokens(
                req.max_tokens, len(ids), self.engine.max_model_len, param
            )
        label = request.state.request_id
        echo = req.echo and isinstance(req, CompletionRequest)
        return Job(
            chat=chat,
            request_id=engine_request_id(label),
            label=label,
            model=self.engine.model_name,
            prompt_ids=ids,
            params=req.sampling_params(max_tokens),
            req=req,
            strings=self.strings if req.logprobs is not None else None,
            echo_text=(req.prompt_text or "") if echo else None,  # type: ignore[attr-defined]
        )

    def _finish(self, job: Job, reason: str) -> None:
        now = time.monotonic()
        ttft = None if job.first_token_at is None else job.first_token_at - job.arrival
        self.metrics.observe_finished(
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

    async def _run(self, request: Request, job: Job) -> Response:
        from engine.tokenizer import IncrementalDetokenizer

        kv = job.req.kv_transfer_params  # a P/D leg: its transfer id joins it to the proxy's log
        leg = f", transfer {kv.transfer_id}" if kv is not None and kv.transfer_id else ""
        logger.info(
            "request %s (label %s%s): %s prompt=%d tokens max_tokens=%d stream=%s",
            job.request_id, job.label, leg, job.endpoint, len(job.prompt_ids),
            job.params.max_tokens, job.req.stream,
        )  # fmt: skip
        if job.req.ignored_fields:  # accepted and ignored, as vLLM does
            logger.warning(
                "request %s: the following fields were present in the request but ignored: %s",
                job.request_id, _field_names(job.req.ignored_fields),
            )  # fmt: skip
        detok = IncrementalDetokenizer(self.engine.tokenizer, prompt_ids=job.prompt_ids)
        steps = generate_steps(self.engine, job, detok)
        try:
            if not job.req.stream:
                body = await race_disconnect(request, self._collect(job, steps))
                return JSONResponse(body, headers={ENGINE_ID_HEADER: job.request_id})
            first = await race_disconnect(request, anext(steps, None))
        except ClientDisconnected:
            logger.info("request %s: client disconnected, aborted", job.request_id)
            self._finish(job, "abort")
            return Response(status_code=499)
        if first is None or first.finish_reason == "error":
            await steps.aclose()  # type: ignore[attr-defined]
            self._finish(job, "error")
            raise engine_error(
                self.engine, first.error if first else None, first.error_code if first else None
            )
        return SSEResponse(
            self._stream(job, first, steps), headers={ENGINE_ID_HEADER: job.request_id}
        )

    async def _collect(self, job: Job, steps: AsyncIterator[Step]) -> dict[str, Any]:
        texts: list[str] = []
        ids: list[int] = []
        entries: Logprobs = []
        prompt: Logprobs | None = None
        last = Step("", [], "error", "no output")
        async with contextlib.aclosing(steps):  # type: ignore[type-var]
            async for step in steps:
                texts.append(step.text)
                ids.extend(step.token_ids)
                entries.extend(step.logprobs or [None] * len(step.token_ids))
                prompt = prompt or step.prompt_logprobs
                last = step
                if step.finish_reason is not None:
                    break
        self._finish(job, last.finish_reason or "error")
        if last.finish_reason == "error":
            raise engine_error(self.engine, last.error, last.error_code)
        return job.response("".join(texts), ids, last, entries, prompt)

    async def _stream(
        self, job: Job, first: Step, steps: AsyncIterator[Step]
    ) -> AsyncIterator[str]:
        reason = "abort"  # if the client goes away mid-stream
        try:
            if job.chat:
                yield sse_event(job.chunk(Step("", []), first=True))
            step: Step | None = first
            while step is not None:
                if step.finish_reason == "error":
                    reason = "error"
                    yield sse_event(engine_error(self.engine, step.error, step.error_code).body())
                    break
                yield sse_event(job.chunk(step))
                if step.finish_reason is not None:
                    reason = step.finish_reason
                    break
                step = await anext(steps, None)
            if reason != "error" and job.req.include_usage:
                yield sse_event(job.usage_chunk())
            yield SSE_DONE
        except Exception as e:
            logger.exception("request %s failed while streaming", job.request_id)
            reason = "error"
            yield sse_event(error_body(f"internal error: {e}", "server_error"))
            yield SSE_DONE
        finally:
            with anyio.CancelScope(shield=True):
                await steps.aclose()  # type: ignore[attr-defined]
            self._finish(job, reason)

    async def _guarded(
        self, request: Request, handler: Callable[[], Awaitable[Response]]
    ) -> Response:
        try:
            return await handler()
        except InvalidRequestError as e:  # raised by the engine, e.g. a duplicate request id
            return JSONResponse(error_body(str(e), param=e.param), status_code=400)
        except ClientDisconnected:  # gone before its body was in: nothing was started
            logger.info("request %s: client disconnected", request.state.request_id)
            return Response(status_code=499)
        except APIError as e:
            if e.status_code >= 500:
                logger.warning("request %s: %s", request.state.request_id, e.message)
            return json_error(e)
        except Exception as e:
            if not self.engine.healthy:
                return json_error(engine_error(self.engine, str(e)))
            logger.exception("request %s failed", request.state.request_id)
            return JSONResponse(error_body(f"internal error: {e}", "server_error"), 500)
