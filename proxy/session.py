"""One client request served by a prefill/decode pair: its attempts, retried before the
first token, and the first bytes of a streamed answer.

Non-streaming: P and D are called concurrently; D's answer (all tokens, the first one
included) is the client's. Streaming: as soon as P answers, its first token goes to the
client; D's stream follows with that token dropped (by D itself with
``skip_first_token``, else by ``proxy/client_stream.py``), so each token is sent exactly
once. Requests with stop strings are not pre-streamed (a stop string may start inside
the first token), nor with ``echo`` (the prompt, or chat's final message, comes first),
nor chat requests whose answer is parsed into tool calls (tools with a tool choice other
than "none") or, on a decode node with a reasoning parser (its ``/v1/kv_transfer_info``
says so), into reasoning and content -- D parses the whole answer, P's token included
(often ``<think>``): they stream from D alone.

A pair failing (connection error, timeout, 5xx) before any of D's tokens reached the
client is retried on another pair (``max_retries``). When D's stream is the whole answer
the client's headers wait for D's first token (``DecodeRelay.until_first_token``): an
error event before it is D's answer of the status it stands for (``legs.event_error``:
retried, or the client's 4xx passed through), never a 200 stream holding only an error.
What the stream does after its first bytes when D fails -- reruns (on a pair that must
produce P's streamed first token again: ``rerun_after_first_token``; on any route:
``rerun_whole``), migrations (``--migration-limit``), the terminal error event -- is
``proxy/stream_body.py``; the attempts it needs are launched here.

A node that answers with load (429, or 503 ``overloaded``) is healthy: it stays in
rotation, and the request moves to another node of that role that this request has not
tried; when none is left, the client gets the node's answer and its ``Retry-After``.
These moves are not failures and do not count against ``max_retries``. A decode node
that refused a request for load recently (``Node.shedding``) gets streamed requests
without pre-streaming, so that its refusal can still be the client's 429.

The router may send an attempt to a decode node alone (``--disagg-min-prompt-tokens``;
always for echo without generation, ``echo`` with ``max_tokens`` 0, which decodes
nothing and needs no KV): it prefills the prompt itself and its answer (or stream) is the
client's, as with stop strings. A retry after P's first token was streamed takes a P/D
pair that agrees on that token where one accepts; else D alone reruns it, its whole
answer checked against what the client has (``rerun_after_first_token``). Answers teach
the router (prompt token counts; what the decode node now caches).

How a streamed answer is written for the client (ids, role, the first token dropped
from D's stream) is ``proxy/client_stream.py``; how D's answer is read and relayed, with
the log probabilities D leaves null filled from P's answer, is ``proxy/decode_relay.py``;
what a failed attempt leads to (another pair, a node left out, D alone, the node's answer
for the client) is ``proxy/retries.py``; this module runs the pairs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from engine.httpkit.big_json import parse_off_loop
from engine.server.request_fields import APIError
from kvconnector.base import transfer_seed
from proxy.answers import parse_completion
from proxy.client_stream import ClientStream, Diverged, first_tokens
from proxy.config import ProxyConfig
from proxy.decode_relay import DecodeRelay
from proxy.legs import Attempt, Legs, UpstreamError
from proxy.metrics import ProxyMetrics, StreamError
from proxy.node_client import NodeHTTPError, NodeResponse
from proxy.prefix import answer_suffix
from proxy.retries import Retries
from proxy.router import NoHealthyNode, PairRefused, Route, Router
from proxy.stream_body import StreamBody
from proxy.validation import ProxyRequest

logger = logging.getLogger(__name__)


class Session:
    def __init__(
        self,
        req: ProxyRequest,
        request_id: str,
        cfg: ProxyConfig,
        router: Router,
        legs: Legs,
        metrics: ProxyMetrics,
        index: int | None = None,
        stream_error: StreamError | None = None,
    ) -> None:
        """``index``: this session is that choice of a request with several
        (``proxy/choices.py``): its stream's usage chunk is kept in ``usage``, not sent;
        ``stream_error``: the request's, shared by its choices (else the session's own)."""
        self.req, self.request_id, self.cfg = req, request_id, cfg
        self.index = index
        self.router, self.legs, self.metrics = router, legs, metrics
        self.arrival = time.monotonic()
        self.created = int(time.time())
        self.migrations = 0  # streams moved on after D failed mid-answer
        # What a failed attempt leads to, and the next routes' exclusions. Echo without
        # generation (``echo``, ``max_tokens`` 0) decodes nothing: no KV to move, D computes
        # the prompt (and its log probabilities) alone and answers as a colocated node.
        self.retries = Retries(
            request_id, cfg, router, metrics, decode_alone=req.parsed.echo_without_generation
        )
        self.current: Attempt | None = None
        self.route: Route | None = None
        # Streaming state.
        # An answer D shapes as a whole streams from D alone and is not migrated: echo
        # (completions' prompt, chat's final message) comes before the first token; tool
        # calls and reasoning are parsed from the whole answer, P's token included (it
        # would go out as content), and a replay's parts are not checked (new call ids).
        # Reasoning is known once a decode node is picked (its parser: ``_launch``).
        tools = getattr(req.parsed, "tools", None)
        self.shaped_by_d = bool(
            req.parsed.echo
            or getattr(req.parsed, "chat_echo", "")
            or (tools is not None and tools.parses_calls)
        )
        self.prestream = req.stream and not req.parsed.stop and not self.shaped_by_d
        self.first_chunk: str | None = None
        self._first_tid: str | None = None  # the transfer whose P sampled the first chunk
        self.ttft_seen = False
        self.outcome = "pending"  # "ok", "error" (reported to the client) or still pending
        self._closed = False
        # The router learns the answer when it remembers what nodes cache; not an echoed
        # one: its text begins with the prompt (or chat's final message), which is no
        # text D caches after the prompt (echo without generation: the prompt alone).
        echoed = req.parsed.echo or getattr(req.parsed, "chat_echo", "")
        self.keeps_answer = router.index is not None and req.key is not None and not echoed
        self.out = ClientStream(
            req, request_id, self.created, cfg.node_skip_first_token, index or 0
        )
        # Counts the stream ending with an error event, once per request.
        self.stream_error = stream_error or StreamError(metrics)
        self.relay = DecodeRelay(
            req, request_id, self.out, router, metrics, poll_s=cfg.health_interval,
            keep_usage=index is not None, on_token=self._saw_first_token,
            stream_error=self.stream_error,
        )  # fmt: skip

    # -- shared ----------------------------------------------------------------------------
    @property
    def response_id(self) -> str:
        return self.out.response_id

    @property
    def usage(self) -> dict[str, Any] | None:
        """The stream's usage chunk, kept when this session is one choice of several."""
        return self.relay.usage

    def _launch(self, allow_decode_only: bool = True) -> Attempt:
        """Start the next pair (or decode node alone); raises ``Retries.no_route``'s error
        when no pair is healthy (503 ``no_healthy_nodes``; after a failure, the 502 of a
        request whose retries are spent)."""
        try:
            route = self.router.plan(
                self.req.key,
                self.retries.excluded,
                allow_decode_only=allow_decode_only,
                decode_alone=self.retries.decode_alone,
            )
        except NoHealthyNode as e:
            raise self.retries.no_route(e) from e
        self.retries.attempts += 1
        self.retries.launched()
        self.route = route
        p, d = route.prefill, route.decode
        if self.req.chat and d.reasoning_parser is not None:
            self.shaped_by_d = True  # D splits the answer into reasoning and content
        # Pre-stream P's first token unless D recently refused a request for load: then
        # wait for D's answer, so that a refusal still reaches the client as a 429.
        prestream = self.prestream and p is not None and not d.shedding() and not self.shaped_by_d
        # D drops the first token when the client has it (or will have it from P).
        skip = self.cfg.node_skip_first_token and p is not None
        skip = skip and (prestream or self.out.sent_ids is not None)
        self.current = Attempt(
            self.legs, self.req, p, d, self.request_id, skip,
            poll_s=self.cfg.health_interval, d_checks=self.cfg.unreachable_checks,
        )  # fmt: skip
        self.current.prestream = prestream
        self.current.on_release = functools.partial(self.router.finish, route)
        # The pair as it was now: a refusal is remembered for these nodes, not for a
        # restart of one that the health checks saw meanwhile.
        self.current.pair_key = self.router.pair_key(p, d) if p is not None else None
        if p is not None:
            logger.info(
                "request %s: %s via prefill %s + decode %s (attempt %d, transfer %s)",
                self.request_id, self.req.endpoint, p.url, d.url, self.retries.attempts,
                self.current.transfer_id,
            )  # fmt: skip
        else:
            logger.info(
                "request %s: %s on decode %s alone, prompt ~%.0f tokens, ~%.0f cached there "
                "(attempt %d, transfer %s)",
                self.request_id, self.req.endpoint, d.url, route.prompt_tokens or 0,
                route.decode_cached_tokens or 0, self.retries.attempts, self.current.transfer_id,
            )  # fmt: skip
        return self.current

    def answered(
        self, text: str, ids: list[int], calls: list[dict[str, Any]], reasoned: bool
    ) -> None:
        """The decode node finished the answer: tell the router what it now caches (a
        chat answer's tool ``calls``, and whether it had reasoning: ``answer_suffix``)."""
        if self.route is not None and self.req.key is not None:
            suffix = answer_suffix(self.req.key, text, ids, calls, reasoned)
            self.router.answered(self.route, self.req.key, suffix)

    def _saw_first_token(self) -> None:
        if not self.ttft_seen:
            self.ttft_seen = True
            self.metrics.ttft.observe(time.monotonic() - self.arrival)

    def close(self) -> None:
        """Release whatever pair is still held (client gone, error, or done)."""
        if self.current is not None:
            self.current.release()
            self.current = None
        self.relay.close()
        if not self._closed:
            self._closed = True
            elapsed = time.monotonic() - self.arrival
            self.metrics.e2e.observe(elapsed)
            # The end of every request, as a node logs its own ("pending": it ended
            # without an answer -- refused, failed, or the client left).
            outcome = self.outcome if self.outcome != "pending" else "ended without an answer"
            logger.info(
                "request %s finished: %s after %d attempt(s), %.3f s",
                self.request_id, outcome, self.retries.attempts, elapsed,
            )  # fmt: skip

    # -- non-streaming ---------------------------------------------------------------------
    async def complete(self) -> dict[str, Any]:
        """The whole answer as one JSON body (D's, with the proxy's id)."""
        while True:
            attempt = self._launch()
            try:
                resp = await self._wait_decode(attempt)
                raw = await attempt.watched(resp.aread())
                attempt.finished = True
                attempt.d.mark_answered()
                body = await parse_off_loop(parse_completion, raw)  # may be large
            except UpstreamError as e:
                self.retries.failed(attempt, e)
                continue
            except (NodeHTTPError, ValueError) as e:
                self.retries.failed(attempt, UpstreamError(attempt.d, f"reading the answer: {e}"))
                continue
            self._saw_first_token()
            body.pop("kv_transfer_params", None)
            body["id"] = self.response_id
            self.relay.restart()
            await self.relay.fill_logprobs(body, attempt)
            await self.relay.fix_cached_tokens(body.get("usage"), attempt)
            if self.req.parsed.prompt_logprobs is not None:
                await self.relay.fill_prompt_logprobs(body, attempt)
            self.outcome = "ok"
            self.router.observe_usage(self.req.key, body)
            if self.keeps_answer:
                with contextlib.suppress(KeyError, IndexError, TypeError, AttributeError):
                    choice = body["choices"][0]
                    msg = choice["message"] if self.req.chat else {}
                    text = msg["content"] if self.req.chat else choice["text"]
                    self.answered(
                        text or "", list(choice.get("token_ids") or []),
                        msg.get("tool_calls") or [], bool(msg.get("reasoning_content")),
                    )  # fmt: skip
            return body

    # -- streaming -------------------------------------------------------------------------
    async def start_stream(self) -> None:
        """Run pairs until the first bytes for the client are known (or raise): P's first
        token, or D's when D's stream is the whole answer -- its headers wait for it, so
        that D failing before it (its error event too) is retried or answered with an
        HTTP status, never a 200 stream holding only the error."""
        while True:
            attempt = self._launch()
            try:
                if attempt.prestream:
                    first = await self._first_token(attempt)
                    if first is not None:
                        self.first_chunk = self._first_chunk(first)
                        self._first_tid = attempt.transfer_id
                        return
                else:
                    await self._wait_decode(attempt)
                await self.relay.until_first_token(attempt)
                return
            except UpstreamError as e:
                self.retries.failed(attempt, e)

    def events(self) -> AsyncIterator[str]:
        """The SSE body (``proxy/stream_body.py``). Must run after ``start_stream``; always
        ends with [DONE], and closes the session."""
        return StreamBody(self).events()

    async def _first_token(self, attempt: Attempt) -> dict[str, Any] | None:
        """P's answer, whose first token goes to the client before D's stream; or None:
        D's stream is the client's whole answer, because D's first token came before P's
        answer, or P became unreachable (its health check got no answer: a hung P never
        answers; D recomputes the prompt when its KV does not come). With
        ``node_skip_first_token`` D's stream lacks the first token, so P becoming
        unreachable fails the attempt instead (retried). A P that answers "not ready"
        (draining) finishes its legs: it is waited for."""
        p_task, p = attempt.p_task, attempt.p
        assert p_task is not None and p is not None
        whole_from_d = not self.cfg.node_skip_first_token
        peek: asyncio.Future[None] | None = None
        try:
            while not p_task.done():
                waits: set[asyncio.Future[Any]] = {p_task}
                d_open = attempt.d_task.done()
                if not d_open:
                    waits.add(attempt.d_task)
                    if (err := attempt.d_gone()) is not None:
                        raise err  # P would wait for D's reservation until its KV timeout
                elif attempt.d_task.exception() is not None:
                    raise attempt.d_task.exception()  # type: ignore[misc]
                elif whole_from_d:
                    if peek is None:
                        peek = asyncio.ensure_future(self.relay.events_of(attempt).until_token())
                    waits.add(peek)
                await asyncio.wait(
                    waits, timeout=self.cfg.health_interval, return_when=asyncio.FIRST_COMPLETED
                )
                if peek is not None and peek.done():
                    # D's stream failed before its first token (and P's, if it came, is
                    # not sent): nothing went to the client, another pair may serve it.
                    self.relay.check_first_token(attempt)
                if p_task.done():
                    break
                if peek is not None and peek.done():
                    logger.info(
                        "request %s: decode node's first token came before the prefill "
                        "answer; streaming the decode node's answer", self.request_id,
                    )  # fmt: skip
                    return None
                if p.unreachable:
                    if not whole_from_d:
                        raise UpstreamError(p, "unreachable before its first token")
                    if attempt.d_task.done() and attempt.d_task.exception() is None:
                        logger.warning(
                            "request %s: prefill node %s unreachable before its first "
                            "token; streaming the decode node's answer (it recomputes the "
                            "prompt when the KV does not come)", self.request_id, p.url,
                        )  # fmt: skip
                        return None
            err = None if p_task.cancelled() else p_task.exception()
            if whole_from_d and self.retries.d_may_answer_alone(attempt, err):
                assert isinstance(err, UpstreamError)
                await self._decode_despite_prefill(attempt, err)
                return None
            return p_task.result()
        finally:
            if peek is not None and not peek.done():
                peek.cancel()  # a read in flight stays with the stream (see DecodeEvents)

    async def _wait_decode(self, attempt: Attempt) -> NodeResponse:
        """D's open answer of ``attempt``; P failing first, when D may answer alone
        (``Retries.d_may_answer_alone``), leaves D's answer the client's whole one --
        non-streamed or streamed from D alone (not pre-streamed) alike."""
        try:
            return await attempt.wait_decode()
        except UpstreamError as e:
            if e.node is not attempt.p or not self.retries.d_may_answer_alone(attempt, e):
                raise
            return await self._decode_despite_prefill(attempt, e)

    async def _decode_despite_prefill(self, attempt: Attempt, err: UpstreamError) -> NodeResponse:
        """P failed (``Retries.d_may_answer_alone``): P leaves the rotation, and D's answer (its
        headers come with its first token) is awaited, watched for a hung D."""
        err.mark_failed()
        logger.warning(
            "request %s: %s, and no other prefill node is ready; the decode node answers "
            "alone (it recomputes the prompt when its KV does not come)", self.request_id, err,
        )  # fmt: skip
        # Shielded: giving D up must not cancel its leg here (``release`` does that).
        attempt.d_stream = await attempt.watched(asyncio.shield(attempt.d_task))
        return attempt.d_stream

    def _first_chunk(self, p_body: dict[str, Any]) -> str:
        self.router.observe_usage(self.req.key, p_body)
        self._saw_first_token()
        return self.out.first_chunk(p_body)

    # -- the attempts of a stream under way (``proxy/stream_body.py`` asks for them) --------
    async def rerun_after_first_token(self) -> NodeResponse:
        """D failed after P's token was streamed: rerun a pair that agrees on that token.
        An unseeded sampled request is rerun with the seed its first pair drew from (the
        transfer id's, ``kvconnector.base.transfer_seed``), so that the rerun samples the
        same tokens. When no decode node accepts a prefill node (``PairRefused``), D alone
        reruns it: its stream repeats the whole answer, P's token included, and all the
        client has is checked and dropped (``ClientStream.whole_answer_next``)."""
        self._seed_from(self._first_tid)
        while True:
            try:
                attempt = self._launch(allow_decode_only=self.retries.decode_alone)
            except APIError as e:
                if not isinstance(e.__cause__, PairRefused):
                    raise
                self.retries.decode_alone = True  # every later rerun too: no pair will be found
                continue
            if attempt.decode_only:
                self.out.whole_answer_next()
                self.out.decode_starts()
                try:
                    return await attempt.wait_decode()
                except UpstreamError as e:
                    self.retries.failed(attempt, e)
                    continue
            try:
                first = await attempt.wait_prefill(poll_s=self.cfg.health_interval)
                ids, _ = first_tokens(first, self.req.chat)
                if ids != self.out.sent_ids:
                    attempt.release()
                    raise Diverged(f"first token {ids!r:.40} for {self.out.sent_ids!r:.40}")
                return await attempt.wait_decode()
            except UpstreamError as e:
                self.retries.failed(attempt, e)

    async def rerun_whole(self, tid: str) -> NodeResponse:
        """D failed while its stream was the client's whole answer (not pre-streamed):
        rerun the request on any route, D's stream again the whole answer (what the client
        has is checked and dropped, ``ClientStream``). An unseeded sampled request reruns
        with the seed of the transfer ``tid`` whose D it was (``transfer_seed``: a node
        seeds a leg by its transfer id)."""
        self._seed_from(tid)
        self.prestream = False
        while True:
            attempt = self._launch()
            try:
                return await attempt.wait_decode()
            except UpstreamError as e:
                self.retries.failed(attempt, e)

    def _seed_from(self, tid: str | None) -> None:
        """Reruns of an unseeded request sample with the seed transfer ``tid`` drew from."""
        if self.req.body.get("seed") is None and tid is not None:
            seed = transfer_seed(tid)
            self.req = dataclasses.replace(self.req, body={**self.req.body, "seed": seed})
