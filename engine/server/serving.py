"""The node's OpenAI handlers: a request becomes a ``Job`` (``job_builder.py``), its steps a
response or a stream."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.config import DEFAULT_MAX_LOGPROB_ENTRIES
from engine.httpkit.admission import Admission, overloaded_body
from engine.httpkit.big_json import json_response, may_be_large, off_loop, render_event
from engine.httpkit.body import read_body
from engine.httpkit.disconnect import ClientDisconnected, race_disconnect
from engine.httpkit.errors import json_error
from engine.httpkit.fanout import (
    gather_or_cancel,
    merge_bodies,
    merge_streams,
    opened_in_index_order,
    sum_usage,
)
from engine.httpkit.listen import DEFAULT_MAX_REQUEST_BYTES
from engine.httpkit.sse import SSE_DONE, SSEResponse, sse_event
from engine.outputs import Logprobs
from engine.sampling_params import MAX_LOGPROBS, InvalidRequestError
from engine.server.engine_client import EngineClient
from engine.server.job_builder import JobBuilder
from engine.server.jobs import Job, Step, engine_error, generate_steps, prompt_only, step_error
from engine.server.json_body import parse_json_body
from engine.server.metrics import ServerMetrics
from engine.server.request_fields import APIError, error_body

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


class OpenAIServing:
    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        trust_request_chat_template: bool = False,
        log_requests: bool = True,
        sampling_defaults: dict[str, Any] | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        served_names: list[str] | None = None,
        max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES,
        prompt_tokens_details: bool = False,
    ) -> None:
        """``log_requests``: each request's start and end at INFO, else DEBUG
        (``--disable-log-requests``). The others are the ``JobBuilder``'s: how a request
        becomes its jobs."""
        self.builder = JobBuilder(
            engine, tool_call_parser, reasoning_parser, trust_request_chat_template,
            sampling_defaults, max_logprobs, served_names, max_logprob_entries,
            prompt_tokens_details,
        )  # fmt: skip
        self.request_log_level = logging.INFO if log_requests else logging.DEBUG
        self.engine = engine
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        # The node's bound on requests held (the app's middleware admits each HTTP
        # request); a request with several choices takes one more per extra choice.
        self.admission: Admission | None = None

    async def _body(self, request: Request, max_bytes: int | None = None) -> bytes:
        return await read_body(request, max_bytes or self.max_request_bytes)

    # -- endpoints ----------------------------------------------------------------------------
    # Parsing, validation and tokenization run in a worker thread: a huge body (a long token
    # list, a long text) must not hold the event loop that serves every other client.
    async def completions(self, request: Request) -> Response:
        async def handle() -> Response:
            raw = await self._body(request)
            n, choices = await anyio.to_thread.run_sync(self.builder.prepare_completion, raw)
            return await self._run(request, self.builder.jobs(request, False, choices, n), n)

        return await self._guarded(request, handle)

    async def chat_completions(self, request: Request, max_bytes: int | None = None) -> Response:
        """``max_bytes``: the body's size cap when not ``--max-request-bytes`` (a translated
        ``/v1/responses`` body)."""

        async def handle() -> Response:
            raw = await self._body(request, max_bytes)
            n, choices = await anyio.to_thread.run_sync(self.builder.prepare_chat, raw)
            return await self._run(request, self.builder.jobs(request, True, choices, n), n)

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

    # -- one job ------------------------------------------------------------------------------
    def _finish(self, job: Job, reason: str) -> None:
        """``reason`` "abort" (the client went away, the answer cut) counts as how the
        engine ended the request when it had ended by itself: one finish reason for it,
        as the engine's metrics count it."""
        if job.reported:  # once per job, whichever path saw it end first
            return
        if reason == "abort" and job.ended_as is not None:
            reason = job.ended_as
        job.reported, job.outcome = True, reason
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
        logger.log(
            self.request_log_level,
            "request %s finished: %s, prompt=%d completion=%d tokens, %.3fs",
            job.request_id, reason, len(job.prompt_ids), job.completion_tokens, now - job.arrival,
        )  # fmt: skip

    def _log_start(self, job: Job) -> None:
        kv = job.req.kv_transfer_params  # a P/D leg: its transfer id joins it to the proxy's log
        leg = f", transfer {kv.transfer_id}" if kv is not None and kv.transfer_id else ""
        logger.log(
            self.request_log_level,
            "request %s (label %s%s): %s prompt=%d tokens max_tokens=%d stream=%s",
            job.request_id, job.label, leg, job.endpoint, len(job.prompt_ids),
            job.params.max_tokens, job.req.stream,
        )  # fmt: skip
        if job.req.ignored_fields and job.index == 0:  # accepted and ignored, as vLLM does
            logger.warning(
                "request %s: the following fields were present in the request but ignored: %s",
                job.request_id, _field_names(job.req.ignored_fields),
            )  # fmt: skip

    def _steps(self, job: Job) -> AsyncIterator[Step]:
        from engine.tokenizer import IncrementalDetokenizer

        detok = IncrementalDetokenizer(
            self.engine.tokenizer, job.prompt_ids, job.req.skip_special_tokens
        )
        steps = generate_steps(self.engine, job, detok)
        return prompt_only(job, steps) if job.req.echo_without_generation else steps

    async def _run(self, request: Request, jobs: list[Job], n: int = 1) -> Response:
        if len(jobs) > 1:
            return await self._run_many(request, jobs, n)
        job = jobs[0]
        self._log_start(job)
        steps = self._steps(job)
        try:
            if not job.req.stream:
                body = await race_disconnect(request, self._collect(job, steps))
                headers = {ENGINE_ID_HEADER: job.request_id}
                return await json_response(body, headers=headers, large=may_be_large(job.req))
            first = await race_disconnect(request, anext(steps, None))
        except ClientDisconnected:
            logger.info("request %s: client disconnected, aborted", job.request_id)
            self._finish(job, "abort")
            return Response(status_code=499)
        if first is None or first.finish_reason == "error":
            await steps.aclose()  # type: ignore[attr-defined]
            self._finish(job, "error")
            raise step_error(self.engine, job, first)

        async def cleanup() -> None:  # a client gone before the stream's first byte
            await steps.aclose()  # type: ignore[attr-defined]
            self._finish(job, "abort")

        return SSEResponse(
            self._stream(job, first, steps),
            headers={ENGINE_ID_HEADER: job.request_id},
            on_close=cleanup,
        )

    async def _collect(self, job: Job, steps: AsyncIterator[Step]) -> dict[str, Any]:
        texts: list[str] = []
        pieces: list[tuple[str, int]] = []  # each step's text and its tokens
        ids: list[int] = []
        entries: Logprobs = []
        prompt: Logprobs | None = None
        last = Step("", [], "error", "no output")
        async with contextlib.aclosing(steps):  # type: ignore[type-var]
            async for step in steps:
                texts.append(step.text)
                pieces.append((step.text, len(step.token_ids)))
                ids.extend(step.token_ids)
                entries.extend(step.logprobs or [None] * len(step.token_ids))
                prompt = prompt or step.prompt_logprobs
                last = step
                if step.finish_reason is not None:
                    break
        self._finish(job, last.finish_reason or "error")
        if last.finish_reason == "error":
            raise step_error(self.engine, job, last)
        text = "".join(texts)
        if not may_be_large(job.req):
            return job.response(text, ids, last, entries, prompt, pieces)
        # Off the loop: with log probabilities it may be millions of entries.
        return await off_loop(job.response, text, ids, last, entries, prompt, pieces)

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
                    yield sse_event(step_error(self.engine, job, step).body())
                    break
                yield await self._event(job, step)
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

    # -- several choices (n > 1, a batch of prompts) ------------------------------------------
    async def _run_many(self, request: Request, jobs: list[Job], n: int) -> Response:
        """Every choice is its own engine request, run together; one body (choices merged,
        usage summed) or one stream (each chunk naming its choice's ``index``). A choice
        failing fails the request and aborts the others. Each choice past the first is
        admitted like a request of its own (``--max-num-seqs`` + ``--max-queued-requests``:
        429 past it)."""
        extra = len(jobs) - 1
        refused = self._admit_more(extra, n)
        if refused is not None:
            return refused
        steps: list[AsyncIterator[Step]] = []
        cleaned = False

        async def cleanup() -> None:
            """Once, whichever path ends the request (a stream's response runs it also
            when its body never started): what did not end by itself is aborted."""
            nonlocal cleaned
            if cleaned:
                return
            cleaned = True
            with anyio.CancelScope(shield=True):
                for s in steps:
                    await s.aclose()  # type: ignore[attr-defined]
            for job in jobs:
                self._finish(job, "abort")
            self._leave(extra)

        streaming = False
        try:
            for job in jobs:
                self._log_start(job)
            steps = [self._steps(job) for job in jobs]
            if not jobs[0].req.stream:
                work = [self._collect(job, s) for job, s in zip(jobs, steps, strict=True)]
                bodies = await race_disconnect(request, gather_or_cancel(work))
                large = may_be_large(jobs[0].req)
                return await json_response(merge_bodies(bodies, n), large=large)
            firsts = await race_disconnect(request, gather_or_cancel([anext(s, None) for s in steps]))  # fmt: skip
            failed = (i for i, f in enumerate(firsts) if f is None or f.finish_reason == "error")
            bad = next(failed, None)
            if bad is not None:
                self._finish(jobs[bad], "error")  # the others: aborted below
                raise step_error(self.engine, jobs[bad], firsts[bad])
            streaming = True
            return SSEResponse(self._stream_many(jobs, firsts, steps, n), on_close=cleanup)
        except ClientDisconnected:
            logger.info("request %s: client disconnected, aborted", jobs[0].label)
            return Response(status_code=499)
        finally:
            if not streaming:
                await cleanup()

    def _admit_more(self, extra: int, n: int) -> Response | None:
        """None when ``extra`` more requests fit the node's bound, else the answer: 429
        (retry later), or 400 when the request could never fit."""
        a = self.admission
        if a is None or a.limit is None or a.try_enter(extra):
            return None
        if extra + 1 > a.limit:
            err = APIError(
                f"the request has {extra + 1} choices; this node holds at most {a.limit} "
                "requests at once (--max-num-seqs + --max-queued-requests)",
                param="n" if n > 1 else "prompt",
            )
            return json_error(err)
        headers = {"Retry-After": str(a.retry_after_s)}
        return JSONResponse(overloaded_body(a.limit), status_code=429, headers=headers)

    def _leave(self, extra: int) -> None:
        if self.admission is not None and self.admission.limit is not None:
            self.admission.leave(extra)

    async def _chunks(
        self, job: Job, first: Step, steps: AsyncIterator[Step]
    ) -> AsyncIterator[Any]:
        """One choice's stream events; an ``APIError`` as its last item if it failed."""
        if job.chat:
            yield sse_event(job.chunk(Step("", []), first=True))
        step: Step | None = first
        while step is not None:
            if step.finish_reason == "error":
                self._finish(job, "error")
                yield step_error(self.engine, job, step)
                return
            yield await self._event(job, step)
            if step.finish_reason is not None:
                self._finish(job, step.finish_reason)
                return
            step = await anext(steps, None)

    async def _stream_many(
        self, jobs: list[Job], firsts: list[Step | None], steps: list[AsyncIterator[Step]], n: int
    ) -> AsyncIterator[str]:
        """The merged stream; its response's ``on_close`` aborts what is left (the client
        went away, or a choice failed) and gives the admission places back."""
        chunks = [
            self._chunks(job, first, s)  # type: ignore[arg-type]
            for job, first, s in zip(jobs, firsts, steps, strict=True)
        ]
        try:
            failed = False
            merged = merge_streams(chunks)
            # The choices open in index order, as vLLM's (the openai package relies on it).
            ordered = opened_in_index_order(merged, urgent=lambda c: isinstance(c, APIError))
            async with contextlib.aclosing(merged), contextlib.aclosing(ordered):
                async for _, chunk in ordered:
                    if isinstance(chunk, APIError):
                        failed = True
                        yield sse_event(chunk.body())
                        break
                    yield chunk  # an event (``_event``)
            if not failed and jobs[0].req.include_usage:
                body = jobs[0].envelope([], stream=True)
                body["usage"] = sum_usage([job.usage() for job in jobs], n)
                yield sse_event(body)
            yield SSE_DONE
        except Exception as e:
            logger.exception("request %s failed while streaming", jobs[0].request_id)
            yield sse_event(error_body(f"internal error: {e}", "server_error"))
            yield SSE_DONE

    @staticmethod
    async def _event(job: Job, step: Step) -> str:
        """The event of ``job``'s chunk of ``step``. The chunk that echoes the prompt with
        its log probabilities (4,000 tokens x 21 entries: ~0.2 s of CPU, seconds at 32k) is
        built and rendered off the event loop; the others (a few tokens each) on it."""
        if job.echoes_logprobs:
            return await off_loop(lambda: "".join(map(render_event, job.chunks(step))))
        return "".join(map(sse_event, job.chunks(step)))

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
