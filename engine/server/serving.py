"""The node's OpenAI handlers: a request becomes a ``Job``, its steps a response or a stream."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.bad_words import tokenize_bad_words
from engine.config import DEFAULT_MAX_LOGPROB_ENTRIES
from engine.generation_config import apply_defaults
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
from engine.reasoning import PARSERS as REASONING_PARSERS
from engine.reasoning import parser_class as reasoning_parser_class
from engine.reasoning.output import ReasoningOutput
from engine.reasoning.tokens import ReasoningTokens, TagIds
from engine.sampling_params import MAX_LOGPROBS, InvalidRequestError
from engine.server.chat_protocol import (
    check_request_template,
    parse_chat_request,
    template_kwargs,
    thinking_kwargs,
)
from engine.server.engine_client import EngineClient
from engine.server.jobs import Job, Step, engine_error, generate_steps, prompt_only, step_error
from engine.server.json_body import parse_json_body
from engine.server.logprobs import TokenIdStrings, TokenStrings
from engine.server.metrics import ServerMetrics
from engine.server.protocol import BaseRequest, CompletionRequest, parse_completion_request
from engine.server.request_checks import (
    check_logprob_entries,
    check_logprobs,
    check_model,
    check_structured,
    check_token_ids,
    logprob_entries,
    resolve_max_tokens,
    truncate_prompt,
)
from engine.server.request_fields import APIError, error_body
from engine.server.tokenize import render_chat
from engine.structured.matcher import start_allows_any
from engine.structured.reasoning import ReasoningTags
from engine.tools.output import ToolOutput, new_parser
from engine.tools.parsers import PARSERS

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


# A request's ``n`` and its choices: one (request, prompt ids) each, prompt-major
# (``BaseRequest.children``); a prompt is tokenized once for its ``n`` choices.
Choices = tuple[int, list[tuple[BaseRequest, list[int]]]]


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
    ) -> None:
        """``tool_call_parser``: the parser of "auto" tool choice (``--enable-auto-tool-choice
        --tool-call-parser NAME``); None: such requests are refused (vLLM's rule).
        ``reasoning_parser``: splits chat answers into reasoning and content
        (``--reasoning-parser NAME``); None: chat answers are content.
        ``trust_request_chat_template``: a request may bring its own chat template
        (``--trust-request-chat-template``); else such requests are a 400.
        ``log_requests``: each request's start and end at INFO, else DEBUG
        (``--disable-log-requests``). ``sampling_defaults``: the sampling fields of
        requests that do not set them, and ``max_tokens`` a cap on every answer
        (``--generation-config``). ``max_logprobs``: ``--max-logprobs``.
        ``served_names``: every name a request's ``model`` may give (default: the
        engine's ``model_name``). ``max_logprob_entries``: the most log-probability entries
        the answer of a request with several choices may hold (``--max-logprob-entries``)."""
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"unknown tool call parser {tool_call_parser!r}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {reasoning_parser!r} "
                f"(choose from {', '.join(sorted(REASONING_PARSERS))})"
            )
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.trust_request_chat_template = trust_request_chat_template
        self.request_log_level = logging.INFO if log_requests else logging.DEBUG
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_logprobs = max_logprobs
        self.max_logprob_entries = max_logprob_entries
        self.served_names = served_names or [engine.model_name]
        self.engine = engine
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        self._strings: TokenStrings | None = None  # token names for logprobs, made once
        # The node's bound on requests held (the app's middleware admits each HTTP
        # request); a request with several choices takes one more per extra choice.
        self.admission: Admission | None = None
        self._id_strings: TokenStrings | None = None  # ... with return_tokens_as_token_ids

    @functools.cached_property
    def reasoning_tags(self) -> ReasoningTags:
        """The reasoning parser's tags in this node's token ids (tokenized once)."""
        assert self.reasoning_parser is not None
        parser = reasoning_parser_class(self.reasoning_parser)
        return ReasoningTags.of(parser, self.engine.tokenizer)

    @functools.cached_property
    def reasoning_tag_ids(self) -> TagIds:
        """The reasoning tags in this node's token ids, both of them (tokenized once): an
        answer's reasoning tokens are counted between them."""
        return TagIds.of(self.engine.tokenizer)

    @property
    def strings(self) -> TokenStrings:
        if self._strings is None:
            self._strings = TokenStrings(self.engine.tokenizer)
        return self._strings

    def _strings_for(self, req: BaseRequest) -> TokenStrings | None:
        if req.logprobs is None and req.prompt_logprobs is None:
            return None
        if not req.return_tokens_as_token_ids:
            return self.strings
        if self._id_strings is None:
            self._id_strings = TokenIdStrings(self.engine.tokenizer)
        return self._id_strings

    async def _body(self, request: Request, max_bytes: int | None = None) -> bytes:
        return await read_body(request, max_bytes or self.max_request_bytes)

    # -- endpoints ----------------------------------------------------------------------------
    # Parsing, validation and tokenization run in a worker thread: a huge body (a long token
    # list, a long text) must not hold the event loop that serves every other client.
    async def completions(self, request: Request) -> Response:
        async def handle() -> Response:
            raw = await self._body(request)
            n, choices = await anyio.to_thread.run_sync(self._prepare_completion, raw)
            return await self._run(request, self._jobs(request, False, choices, n), n)

        return await self._guarded(request, handle)

    async def chat_completions(self, request: Request, max_bytes: int | None = None) -> Response:
        """``max_bytes``: the body's size cap when not ``--max-request-bytes`` (a translated
        ``/v1/responses`` body)."""

        async def handle() -> Response:
            raw = await self._body(request, max_bytes)
            n, choices = await anyio.to_thread.run_sync(self._prepare_chat, raw)
            return await self._run(request, self._jobs(request, True, choices, n), n)

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

    def _prepare_completion(self, raw: bytes) -> Choices:
        req = parse_completion_request(apply_defaults(parse_json_body(raw), self.sampling_defaults))
        self._check_serving(req)
        children = req.children()
        out: list[tuple[BaseRequest, list[int]]] = []
        for k in range(0, len(children), req.n):
            one: Any = children[k]
            text, given = one.prompt_text, one.prompt_token_ids
            if given is not None:
                where = "prompt" if len(children) == req.n else f"prompt[{k // req.n}]"
                check_token_ids(given, self.engine.vocab_size, where)
                full = given
            else:
                full = list(self.engine.tokenizer.encode(text or ""))
            ids = truncate_prompt(full, req.truncate_prompt_tokens, self.engine.max_model_len)
            if req.echo and (given is not None or len(ids) < len(full)):
                # The text echoed before the answer: the prompt the model saw.
                text = self.engine.tokenizer.decode(ids, req.skip_special_tokens)
            for child in children[k : k + req.n]:
                child.prompt_text = text  # type: ignore[attr-defined]
                out.append((child, ids))
        return req.n, out

    def _prepare_chat(self, raw: bytes) -> Choices:
        req = parse_chat_request(apply_defaults(parse_json_body(raw), self.sampling_defaults))
        check_request_template(req.chat_template, self.trust_request_chat_template)
        if req.structured_output is not None and self._reasons(req):
            # The grammar constrains the content, after the reasoning (vLLM's rule).
            req.reasoning_tags = self.reasoning_tags
        self._check_serving(req)
        if req.tools is not None and req.tools.choice == "auto" and self.tool_call_parser is None:
            raise APIError(  # vLLM's answer
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                'to be set (the default tool choice of a request with tools is "auto")',
                param="tool_choice",
            )
        tok = self.engine.tokenizer
        ids = list(
            tok.encode(
                render_chat(
                    tok,
                    req.messages,
                    template_kwargs(
                        req, req.chat_template is not None or tok.supports_template_kwargs
                    ),
                    req.add_generation_prompt,
                    req.continue_final_message,
                    req.tools.template_tools() if req.tools is not None else None,
                    req.chat_template,
                ),
                add_special_tokens=False,
            )
        )
        ids = truncate_prompt(ids, req.truncate_prompt_tokens, self.engine.max_model_len)
        return req.n, [(child, ids) for child in req.children()]

    # -- one job ------------------------------------------------------------------------------
    def _check_serving(self, req: BaseRequest) -> None:
        check_model(req.model, self.served_names)
        check_logprobs(req, self.max_logprobs, chat=not isinstance(req, CompletionRequest))
        check_token_ids(list(req.logit_bias), self.engine.vocab_size, "logit_bias")
        if req.allowed_token_ids:
            check_token_ids(req.allowed_token_ids, self.engine.vocab_size, "allowed_token_ids")
        so = req.structured_output
        if so is not None:
            check_structured(so)  # 400s: llguidance missing, the grammar invalid
            try:  # compiled for this node's tokenizer here (cached), never on the engine loop:
                # each choice's request gets a copy (``generate_steps``)
                req.grammar_template = self.engine.grammars.compile(so)
            except InvalidRequestError as e:
                raise APIError(str(e), param=e.param, code="invalid_structured_output") from e
            ids = req.allowed_token_ids
            if (
                ids
                and req.reasoning_tags is None  # else the first token need not be the grammar's
                and not start_allows_any(req.grammar_template, ids, self.engine.vocab_size)
            ):
                raise APIError(
                    f"none of 'allowed_token_ids' may begin the structured output "
                    f"('{so.param}'): the answer could not have a first token",
                    param="allowed_token_ids",
                )
        if req.bad_words:  # once per request, off the event loop; its choices share them
            words = tokenize_bad_words(self.engine.tokenizer, req.bad_words)
            # A sequence with an id past the model's vocabulary can never be sampled whole.
            vocab = self.engine.vocab_size
            req.bad_words_token_ids = tuple(seq for seq in words if max(seq) < vocab)
        if not self.engine.healthy:
            raise engine_error(self.engine, None)

    def _reasons(self, req: BaseRequest) -> bool:
        """Whether a chat request's answer is split into reasoning and content."""
        if self.reasoning_parser is None:
            return False
        return reasoning_parser_class(self.reasoning_parser).applies(thinking_kwargs(req))

    def _jobs(
        self,
        request: Request,
        chat: bool,
        choices: list[tuple[BaseRequest, list[int]]],
        n: int = 1,
    ) -> list[Job]:
        """Every choice's job, all checked before any starts (one too long: a 400, no work;
        all together answering more log probabilities than ``--max-logprob-entries``: a 400)."""
        jobs = [
            self._job(request, chat, req, ids, index) for index, (req, ids) in enumerate(choices)
        ]
        first = jobs[0].req
        if len(jobs) > 1 and (first.logprobs is not None or first.prompt_logprobs is not None):
            entries = sum(
                logprob_entries(j.req, len(j.prompt_ids), j.params.max_tokens) for j in jobs
            )
            check_logprob_entries(first, n, len(jobs), entries, self.max_logprob_entries, chat)
        return jobs

    def _job(
        self, request: Request, chat: bool, req: BaseRequest, ids: list[int], index: int = 0
    ) -> Job:
        param = "messages" if chat else "prompt"
        kv = req.kv_transfer_params
        if req.echo_without_generation:
            # vLLM's: the engine samples one token (it cannot stop before one), which the
            # answer leaves out (``prompt_only``). As vLLM's, the check counts the 0 tokens
            # asked for: a prompt may fill the context (the engine takes one that long;
            # its sampled token is never computed, so it needs no room).
            resolve_max_tokens(0, len(ids), self.engine.max_model_len, param)
            max_tokens = 1
        elif kv is not None and kv.do_remote_decode:
            # A prefill leg computes the prompt and one token: this node's context bounds
            # the prompt; the answer's budget is the decode node's to check. A prompt that
            # does not fit is refused with the client's numbers, as D would refuse it (a
            # client behind a proxy may get either leg's 400).
            try:
                resolve_max_tokens(1, len(ids), self.engine.max_model_len, param)
            except APIError:
                resolve_max_tokens(
                    req.max_tokens, len(ids), self.engine.max_model_len, param,
                    req.max_tokens_param,
                )  # fmt: skip
                raise
            max_tokens = req.max_tokens or 1
        else:
            max_tokens = resolve_max_tokens(
                req.max_tokens, len(ids), self.engine.max_model_len, param, req.max_tokens_param
            )
            cap = self.sampling_defaults.get("max_tokens")  # generation config's max_new_tokens
            max_tokens = min(max_tokens, cap) if cap else max_tokens
        label = request.state.request_id
        echo = req.echo and isinstance(req, CompletionRequest)
        tools = getattr(req, "tools", None)
        calls = None
        if (
            tools is not None
            and tools.parses_calls
            and not (kv is not None and kv.do_remote_decode)
        ):
            # A prefill leg's answer (one token, for the proxy) stays plain content.
            calls = ToolOutput(tools, new_parser(tools, self.tool_call_parser))
        reasoning, counted = None, None
        if (
            chat
            and self.reasoning_parser is not None
            and not (kv is not None and kv.do_remote_decode)
        ):
            # A prefill leg's answer (one token, for the proxy) is neither split nor counted.
            parser = reasoning_parser_class(self.reasoning_parser)
            if self._reasons(req):
                reasoning = ReasoningOutput(parser(), calls)
            counted = ReasoningTokens(
                self.reasoning_tag_ids, parser.initial if reasoning else "after"
            )
        return Job(
            chat=chat,
            request_id=engine_request_id(label),
            label=label,
            model=self.engine.model_name,
            prompt_ids=ids,
            params=req.sampling_params(max_tokens),
            req=req,
            strings=self._strings_for(req),
            echo_text=(req.prompt_text or "") if echo else None,  # type: ignore[attr-defined]
            index=index,
            tools=calls,
            reasoning=reasoning,
            reasoning_tokens=counted,
        )

    def _finish(self, job: Job, reason: str) -> None:
        if job.reported:  # once per job, whichever path saw it end first
            return
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
            raise step_error(self.engine, job, last)
        text = "".join(texts)
        if not may_be_large(job.req):
            return job.response(text, ids, last, entries, prompt)
        # Off the loop: with log probabilities it may be millions of entries.
        return await off_loop(job.response, text, ids, last, entries, prompt)

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
            bad = next((f for f in firsts if f is None or f.finish_reason == "error"), False)
            if bad is not False:
                self._finish(jobs[firsts.index(bad)], "error")  # the others: aborted below
                raise step_error(self.engine, jobs[firsts.index(bad)], bad)
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
            return await off_loop(lambda: render_event(job.chunk(step)))
        return sse_event(job.chunk(step))

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
