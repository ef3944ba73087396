"""One generation request as the HTTP layer sees it, and its engine outputs as steps."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from engine.httpkit import openai
from engine.outputs import Logprobs
from engine.reasoning.output import ReasoningOutput
from engine.reasoning.tokens import ReasoningTokens
from engine.sampling_params import SamplingParams
from engine.server.answer_text import AnswerText
from engine.server.chat_echo import lead_with
from engine.server.engine_client import EngineClient
from engine.server.logprobs import (
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_entries,
    trim,
)
from engine.server.protocol import BaseRequest
from engine.server.request_fields import APIError
from engine.tools.output import ToolOutput
from kvconnector.base import KV_NOT_RESERVED

logger = logging.getLogger(__name__)


@dataclass
class Step:
    """Text and token ids produced by one engine output (after stop-string handling)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    error_code: str | None = None  # with error: RequestOutput.error_code
    # With logprobs: one entry per token id; the prompt's in the first step that has ids.
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    # With finish_reason "stop" (vLLM's ``stop_reason``): the stop string that was hit, or
    # the stop token id; None for EOS (the tokenizer's own), a length or an error.
    stop_reason: str | int | None = None


@dataclass
class Job:
    chat: bool
    request_id: str  # the engine's id: unique per request, the key of every engine call
    label: str  # the client's X-Request-Id: logged, echoed, the OpenAI ``id``
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    req: BaseRequest
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    completion_tokens: int = 0
    # Set when the request asked for logprobs: how tokens are named.
    strings: TokenStrings | None = None
    # Completions with echo: the prompt's text, put before the answer's (once).
    echo_text: str | None = None
    _echoed: bool = False
    # Completions text the client was streamed so far (text_offset's base, vLLM's rule),
    # a first token the proxy streamed from the prefill node (skip_first_token) included.
    streamed_chars: int = 0
    # Its place among the request's choices (``n`` > 1, a batch of prompts).
    index: int = 0
    # How it ended (a finish reason, "error", "abort"), once reported (``reported``).
    outcome: str | None = None
    reported: bool = False
    # How the engine ended it, when it ended by itself (or at a stop string): its finish
    # reason everywhere, also when the client went away before the answer's end reached it
    # (the engine's metrics count it so).
    ended_as: str | None = None
    # A chat choice whose tool calls are parsed (tools with a tool choice other than
    # "none"): its text becomes content and tool calls.
    tools: ToolOutput | None = None
    # A chat choice on a node with a reasoning parser (``--reasoning-parser``): its text
    # becomes reasoning and content (the content part going on to ``tools``, if set).
    reasoning: ReasoningOutput | None = None
    # A chat choice on a node with a reasoning parser (not a prefill leg's): its reasoning
    # tokens, counted on its ids (the usage's ``completion_tokens_details``, vLLM's).
    reasoning_tokens: ReasoningTokens | None = None
    # With return_token_ids, a stream's first chunk carried the prompt's ids.
    _prompt_ids_sent: bool = False
    # ``--enable-prompt-tokens-details``: the usage's ``prompt_tokens_details``, with the
    # prompt tokens the engine's prefix cache held (``cached_tokens``) when it started.
    prompt_tokens_details: bool = False
    cached_tokens: int = 0

    @property
    def endpoint(self) -> str:
        return "chat" if self.chat else "completions"

    def usage(self, before_tokens: bool = False, final: bool = True) -> dict[str, Any]:
        """``before_tokens``: the usage of a chunk before any token (a stream's role chunk);
        ``final``: the answer's (its body's, a stream's usage chunk), not a chunk's so far
        (``continuous_usage_stats``), which carries no ``prompt_tokens_details`` (vLLM's)."""
        p, c = len(self.prompt_ids), 0 if before_tokens else self.completion_tokens
        usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        if self.reasoning_tokens is not None:
            r = 0 if before_tokens else self.reasoning_tokens.count
            usage["completion_tokens_details"] = {"reasoning_tokens": r}
        if final and self.prompt_tokens_details and self.cached_tokens:  # 0: absent (vLLM)
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def envelope(self, choices: list[dict[str, Any]], *, stream: bool) -> dict[str, Any]:
        return openai.envelope(self.label, self.chat, stream, self.created, self.model, choices)

    def choice(
        self,
        text: str,
        ids: list[int],
        finish: str | None,
        *,
        stream: bool,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
        stop_reason: str | int | None = None,
        tool_part: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``tool_part``: with tool calls or reasoning, the ``delta`` or ``message`` itself."""
        c: dict[str, Any] = {"index": self.index}
        echo = getattr(self.req, "chat_echo", "") if self.chat and (first or not stream) else ""
        if tool_part is None:
            text = echo + text  # vLLM's chat echo
        else:  # a message parsed into reasoning, content, calls: the echo leads the content
            tool_part = lead_with(tool_part, echo)
        if not self.chat:
            c["text"] = text
        elif tool_part is not None:
            c["delta" if stream else "message"] = tool_part
        elif stream:
            c["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            c["message"] = {"role": "assistant", "content": text}
        c.update(logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason, token_ids=ids)
        return c

    @property
    def echoes_logprobs(self) -> bool:
        """Whether the next stream chunk echoes the prompt with its log probabilities (one
        entry per prompt token: the one large chunk of a stream)."""
        return self.echo_text is not None and not self._echoed and self.req.logprobs is not None

    def _echo(self, text: str, ids: list[int], entries: Logprobs, prompt: Logprobs | None) -> Any:
        """Completions with echo: the prompt's text, ids and entries before the answer's,
        the first time only (a stream echoes in its first chunk with tokens)."""
        if self.echo_text is None or self._echoed:
            return text, ids, entries
        self._echoed = True
        if prompt is None or len(prompt) != len(self.prompt_ids):
            prompt = [None] * len(self.prompt_ids)
        elif self.req.logprobs is not None:  # computed for prompt_logprobs' count too
            prompt = trim(prompt, self.req.logprobs)
        return self.echo_text + text, [*self.prompt_ids, *ids], [*prompt, *entries]

    def _logprobs(
        self, ids: list[int], entries: Logprobs | None, offset: int = 0
    ) -> dict[str, Any] | None:
        if self.strings is None or self.req.logprobs is None:
            return None
        if entries is None or len(entries) != len(ids):
            entries = [None] * len(ids)
        if self.chat:
            return chat_logprobs(ids, entries, self.strings)
        return completion_logprobs(ids, entries, self.strings, offset)[0]

    def chunk(self, step: Step, *, first: bool = False) -> dict[str, Any]:
        """The stream's chunk of ``step`` (``first``: the role's); its last of ``chunks``."""
        return self.chunks(step, first=first)[-1]

    def chunks(self, step: Step, *, first: bool = False) -> list[dict[str, Any]]:
        """The stream's chunks of ``step``: one, or several in the text's order (the first
        with the step's tokens, the last with its finish) when its text has content before
        its reasoning (a reasoning parser) or content after a tool call's piece."""
        text, lp = step.text, None
        if step.token_ids or (self.echo_text is not None and not self._echoed):
            entries = step.logprobs or [None] * len(step.token_ids)
            text, lp_ids, entries = self._echo(text, step.token_ids, entries, step.prompt_logprobs)
            lp = self._logprobs(lp_ids, entries, self.streamed_chars)
        self.streamed_chars += len(text)
        finish, parts = step.finish_reason, [None]
        if self.reasoning is not None and not first:
            parts = self.reasoning.deltas(text, finish is not None, len(step.token_ids))
        elif self.tools is not None and not first:
            parts = self.tools.deltas(text, finish is not None, len(step.token_ids))
        parsed = self.reasoning or self.tools
        if parsed is not None and not first and finish is not None:
            finish = parsed.finish_reason(finish)
        out = []
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            choice = self.choice(
                text, step.token_ids if i == 0 else [], finish if last else None, stream=True,
                first=first, logprobs=lp if i == 0 else None,
                stop_reason=step.stop_reason if last else None, tool_part=part,
            )  # fmt: skip
            out.append(self._chunk_body(choice, step, first, last))
        return out

    def _chunk_body(
        self, choice: dict[str, Any], step: Step, first: bool, last: bool
    ) -> dict[str, Any]:
        body = self.envelope([choice], stream=True)
        if self.req.return_token_ids and not self._prompt_ids_sent:  # the first chunk only
            self._prompt_ids_sent = True
            self._add_prompt_ids(body, choice)
        if self.req.include_usage:
            # The role chunk carries no tokens: 0 so far (vLLM's); the others count the
            # choice's tokens up to theirs.
            body["usage"] = self.usage(first, final=False) if self.req.continuous_usage else None
        if step.kv_transfer_params is not None and last:
            body["kv_transfer_params"] = step.kv_transfer_params
        return body

    def _add_prompt_ids(self, body: dict[str, Any], choice: dict[str, Any]) -> None:
        """``return_token_ids``: vLLM's ``prompt_token_ids``, a chat response's or (a
        completion) its choice's."""
        (body if self.chat else choice)["prompt_token_ids"] = list(self.prompt_ids)

    def usage_chunk(self) -> dict[str, Any]:
        body = self.envelope([], stream=True)
        body["usage"] = self.usage()
        return body

    def response(
        self,
        text: str,
        ids: list[int],
        last: Step,
        entries: Logprobs | None = None,
        prompt: Logprobs | None = None,
        steps: list[tuple[str, int]] | None = None,
    ) -> dict[str, Any]:
        """The body of the answer ``text`` (``steps``: the engine's steps that made it, each
        its text and its number of tokens: a reasoning or tool parser is fed them as a stream is)."""
        entries = entries if entries is not None else [None] * len(ids)
        text, lp_ids, entries = self._echo(text, ids, entries, prompt)
        lp = self._logprobs(lp_ids, entries)
        finish, part = last.finish_reason, None
        parsed = self.reasoning or self.tools
        if parsed is not None and steps is not None:
            part = parsed.message_of(steps)
        elif parsed is not None:
            part = parsed.message(text)
        if parsed is not None and finish is not None:
            finish = parsed.finish_reason(finish)
        choice = self.choice(
            text, ids, finish, stream=False, logprobs=lp, stop_reason=last.stop_reason,
            tool_part=part,
        )  # fmt: skip
        body = self.envelope([choice], stream=False)
        if self.req.return_token_ids:
            self._add_prompt_ids(body, choice)
        k = self.req.prompt_logprobs
        if k is not None and self.strings is not None:  # vLLM's: on the choice; chat: the body
            if prompt is None or len(prompt) != len(self.prompt_ids):
                prompt = [None] * len(self.prompt_ids)
            entries_p = prompt_logprobs_entries(self.prompt_ids, prompt, self.strings, k)
            (body if self.chat else choice)["prompt_logprobs"] = entries_p
        body["usage"] = self.usage()
        if last.kv_transfer_params is not None:
            body["kv_transfer_params"] = last.kv_transfer_params
        return body


def step_error(engine: EngineClient, job: Job, step: Any) -> APIError:
    """``engine_error`` for ``job``'s step that ended with an error (None: no step came);
    a stuck structured output names the request's field that asked for it."""
    so = job.params.structured_output
    return engine_error(
        engine,
        step.error if step is not None else None,
        step.error_code if step is not None else None,
        param=so.param if so is not None else None,
    )


def engine_error(
    engine: EngineClient, message: str | None, code: str | None = None, param: str | None = None
) -> APIError:
    """503 when the engine is dead (with why), a 409 for a prefill leg no decode node
    reserved (``KV_NOT_RESERVED``), a 400 for a structured output its request's own
    constraints left without a next token (naming ``param``, the field that asked for
    it), else a 500 carrying ``message``."""
    if not engine.healthy:
        reason = engine.dead_reason or message or "engine is not running"
        return APIError(
            f"engine unavailable: {reason}",
            status_code=503,
            err_type="server_error",
            code="engine_dead",
        )
    if code == "structured_output_stuck":  # the request's own constraints leave no token
        return APIError(message or code, status_code=400, err_type="invalid_request_error",
                        param=param, code=code)  # fmt: skip
    if code == KV_NOT_RESERVED:
        return APIError(message or code, status_code=409, err_type="invalid_request_error",
                        param="kv_transfer_params", code=code)  # fmt: skip
    return APIError(message or "internal engine error", status_code=500, err_type="server_error")


async def abort_quietly(engine: EngineClient, request_id: str, reason: str = "abort") -> str | None:
    """``reason``: "stop" for a request ended at a stop string; returns how the request had
    ended by itself before the abort, if it had (``EngineClient.abort``)."""
    try:
        with anyio.CancelScope(shield=True):
            return await engine.abort(request_id, reason)
    except Exception:
        logger.warning("abort of request %s failed", request_id, exc_info=True)
        return None


async def settle_quietly(engine: EngineClient, request_id: str, stop_string: bool) -> None:
    """Tell the engine how a request with stop strings that it finished ended
    (``EngineClient.settle``)."""
    try:
        with anyio.CancelScope(shield=True):
            await engine.settle(request_id, stop_string)
    except Exception:
        logger.warning("settling request %s failed", request_id, exc_info=True)


async def prompt_only(job: Job, steps: AsyncIterator[Step]) -> AsyncIterator[Step]:
    """vLLM's echo without generation (``echo`` with ``max_tokens`` 0): ``steps`` of an
    engine request run with ``max_tokens`` 1 (an engine samples at least one token) as
    one final step without that token: no text, ids or log probabilities of its own, so
    the answer is the echoed prompt (and the prompt's log probabilities); "length" (the
    answer's 0 tokens), and no completion tokens in the usage."""
    prompt: Logprobs | None = None
    async with contextlib.aclosing(steps):  # type: ignore[type-var]
        async for step in steps:
            job.completion_tokens = 0
            prompt = prompt or step.prompt_logprobs
            if step.finish_reason is None:
                continue
            if step.finish_reason == "error":
                yield step
                return
            kv = step.kv_transfer_params
            yield Step("", [], "length", kv_transfer_params=kv, prompt_logprobs=prompt)
            return


async def generate_steps(engine: EngineClient, job: Job, detok: Any) -> AsyncIterator[Step]:
    """Engine outputs -> Steps; aborts the engine request unless it finished by itself.

    A token that stopped the answer (a ``stop_token_ids`` entry, or EOS: the engine's
    finish reason "stop") stays in the token ids but its text is left out, unless
    ``include_stop_str_in_output`` (vLLM's detokenizer does the same); stop strings are
    checked on the text without it."""
    # The proxy already streamed the first token it got from the prefill node.
    kv = job.req.kv_transfer_params
    answer = AnswerText(
        detok, job.params, job.req.stop, job.req.include_stop_str_in_output,
        skip_first=kv is not None and kv.skip_first_token,
    )  # fmt: skip
    finished = False
    stopped = False  # a stop string ended the answer (before or with the engine's end)
    outputs = engine.generate(
        job.request_id,
        job.prompt_ids,
        job.params,
        kv_transfer_params=job.req.kv_transfer_params,
        label=job.label,
        priority=job.req.priority,
        grammar=job.req.grammar_template,
        cache_salt=job.req.cache_salt,
    )
    try:
        async for out in outputs:
            if out.new_token_ids and job.first_token_at is None:
                job.first_token_at = time.monotonic()
            job.completion_tokens += len(out.new_token_ids)
            if out.num_cached_tokens is not None:
                job.cached_tokens = out.num_cached_tokens
            piece = answer.add(out)
            job.completion_tokens -= piece.dropped  # past a stop string: not the answer's
            if job.reasoning_tokens is not None:  # the whole answer's ids, P's first included
                new = list(out.new_token_ids)
                new = new[: len(new) - piece.dropped]  # none past a stop string
                job.reasoning_tokens.feed(new[:-1] if piece.stop_token_hidden else new)
                if out.finished or piece.stop_hit:
                    job.reasoning_tokens.finish()
            job.streamed_chars += len(piece.skipped_text)
            text, ids = piece.text, piece.token_ids
            kv_out = out.kv_transfer_params.to_dict() if out.kv_transfer_params else None
            extra = {"logprobs": piece.logprobs, "prompt_logprobs": out.prompt_logprobs}
            if piece.stop_hit:
                finished, stopped = out.finished, True
                job.ended_as = "stop"
                yield Step(
                    text, ids, "stop", kv_transfer_params=kv_out, stop_reason=piece.stop_reason,
                    **extra,
                )  # fmt: skip
                return
            if out.finished:
                finished = True
                job.ended_as = out.finish_reason or "stop"
                yield Step(
                    text, ids, out.finish_reason or "stop", out.error, kv_out, out.error_code,
                    **extra, stop_reason=piece.stop_reason,
                )  # fmt: skip
                return
            if text or ids:
                yield Step(text, ids, **extra)
        finished = True
        yield Step("", [], "error", "engine output stream ended without a final output")
    finally:
        if not finished:
            ended = await abort_quietly(engine, job.request_id, "stop" if stopped else "abort")
            if ended is not None and not stopped:  # it had ended by itself: that counts
                job.ended_as = ended
        elif job.params.stop:  # the engine waits for our word on how it ended
            await settle_quietly(engine, job.request_id, stopped)
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()
