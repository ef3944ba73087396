"""A decode node's answer relayed to the client, with what P computed filled in.

``DecodeRelay`` is the reading half of a ``Session`` (``proxy/session.py`` runs the pairs,
waits and retries, ``proxy/stream_body.py`` the stream's reruns and migrations; ``proxy/client_stream.py`` formats the events): it opens
D's event stream once per attempt (``events_of``; the stream a look-ahead for D's first
token read stays the one relayed; read to that token before the client's headers when
D's stream is the whole answer, ``until_first_token``: a failure before it is the
attempt's), and relays each event: D's error event that is not the client's 4xx is the
attempt's failure, wherever it comes, as a broken connection there is (before any of D's
answer reached the client: rerun, or moved for load; after: the stream moved, or ended by
``proxy/stream_body.py``); the client's 4xx is forwarded and ends the relay
(``d_error``); the usage chunk of one choice of several is kept
(``usage``: the request's is the sum of its choices'), every other event is rewritten by
``ClientStream`` (dropped when nothing of it is left to send), and a token's inter-token
latency is observed.

The rule for log probabilities: D does not compute what P did -- the first token (it
arrives with the KV) and, with ``echo``, the prompt's entries, and vLLM's
``prompt_logprobs`` -- and answers them with a null log probability; they are filled from
P's answer of the same attempt (the same tokens at the same indices,
``engine.server.logprobs.fill_missing``), in D's stream and in D's whole answer alike. P's
answer is awaited at most ``LOGPROBS_WAIT_S`` and no longer once P is unreachable (a hung
P never answers); without it D's entries stay null. A pre-streamed first token carries
P's entry, and D's entry for it is dropped with the token (``ClientStream``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.httpkit.sse import sse_event
from engine.server.logprobs import fill_missing, has_missing, num_entries
from proxy.cached_tokens import prefill_cached_tokens, set_cached_tokens
from proxy.client_stream import ClientStream
from proxy.decode_events import DecodeEvents
from proxy.legs import Attempt, UpstreamError, event_error
from proxy.metrics import ProxyMetrics, StreamError
from proxy.router import Router
from proxy.validation import ProxyRequest
from proxy.waiting import wait_watched

logger = logging.getLogger(__name__)

# How long D's stream may wait for P's answer to fill the log probabilities D left null.
LOGPROBS_WAIT_S = 30.0


class DecodeRelay:
    def __init__(
        self,
        req: ProxyRequest,
        request_id: str,
        out: ClientStream,
        router: Router,
        metrics: ProxyMetrics,
        *,
        poll_s: float,
        keep_usage: bool,
        on_token: Callable[[], None],
        stream_error: StreamError,
    ) -> None:
        """``poll_s``: how often a wait for P's answer looks at P's health;
        ``keep_usage``: the stream's usage chunk is kept in ``usage``, not sent (one choice
        of several, ``proxy/choices.py``); ``on_token``: called when tokens reach the
        client (the session's time to first token); ``stream_error``: the request's count of
        a stream ended by D's error event (once per request, its choices share it)."""
        self.req, self.request_id, self.out = req, request_id, out
        self.router, self.metrics = router, metrics
        self.poll_s, self.keep_usage, self.on_token = poll_s, keep_usage, on_token
        self.stream_error = stream_error
        self.usage: dict[str, Any] | None = None
        self.sent = False  # some of the current D stream reached the client
        self.d_error = False  # D's error event was relayed (the relay's last chunk)
        self._lp_seen = 0  # log-prob entries of D's answer seen so far
        self._last = 0.0  # when the client last got tokens (inter-token latency)
        self._p_answer: tuple[Attempt, Any] | None = None  # P's answer, per attempt
        self._events: DecodeEvents | None = None  # D's stream, read ahead or not
        self._events_for: Attempt | None = None  # the attempt whose stream it is

    def events_of(self, attempt: Attempt) -> DecodeEvents:
        """D's event stream of ``attempt`` (whose D leg answered), made once per attempt."""
        if self._events is None or self._events_for is not attempt:
            if self._events is not None:
                self._events.close()
            attempt.d_stream = attempt.d_task.result()
            events = DecodeEvents(attempt.d_stream, attempt.d_gone, attempt.poll_s)
            self._events, self._events_for = events, attempt
        return self._events

    async def until_first_token(self, attempt: Attempt) -> None:
        """Read D's stream of ``attempt`` ahead to its first token (watched for a hung D):
        the client's headers wait for it, so that a failure before it is still an HTTP
        answer or a retry (``check_first_token``), never a 200 stream holding only an
        error. The events read stay the relay's first."""
        await self.events_of(attempt).until_token()
        self.check_first_token(attempt)

    def check_first_token(self, attempt: Attempt) -> None:
        """Raise ``UpstreamError`` if D's stream of ``attempt``, read ahead, failed before
        its first token: D's error event as the HTTP answer it stands for
        (``legs.event_error``), or the read that broke, or the stream's end."""
        events = self.events_of(attempt)
        if events.ahead_has_token():
            return
        event = events.ahead_error_event()
        if event is not None:
            raise event_error(attempt.d, event)
        raise UpstreamError(
            attempt.d, f"the stream failed before its first token: {events.ahead_error()}"
        )

    def tokens_sent(self) -> None:
        """The client got tokens now (P's first chunk; the start of the stream): the next
        inter-token latency counts from here."""
        self._last = time.monotonic()

    def restart(self) -> None:
        """A D answer (the first, or a rerun's) starts: nothing of it was seen or sent."""
        self._lp_seen, self.sent = 0, False

    async def relay(self, events: DecodeEvents, attempt: Attempt) -> AsyncIterator[str]:
        """D's events of ``attempt``, rewritten for the client (``sent`` once one is
        yielded). D's error event that is the client's 4xx is forwarded and ends the relay
        (``d_error``); any other raises the ``UpstreamError`` it stands for
        (``legs.event_error``), as D's connection breaking there would: before any of D's
        answer reached the client (P's streamed first token may have) the session reruns
        the request (a failure) or moves it (load); after, the stream moves
        (``--migration-limit``) or ends with the proxy's event (``StreamBody``)."""
        async for obj in events:
            if "error" in obj:
                first = not self.sent and not self.out.has_decode_part
                err = event_error(attempt.d, obj, before_token=first)
                if not err.refuses_request:
                    raise err
                # The client's 4xx: D's answer to it, as D sent it.
                self.stream_error.count()
                logger.info("request %s: decode refused it: %s", self.request_id, obj)
                self.d_error = True
                self.sent = True
                yield sse_event(obj)
                return
            if isinstance(obj.get("usage"), dict) and not obj.get("choices"):  # the last
                await self.fix_cached_tokens(obj["usage"], attempt)
                self.router.observe_usage(self.req.key, obj)
                if self.keep_usage:
                    self.usage = obj["usage"]  # the request's is the sum of its choices'
                    continue
            if self.req.parsed.logprobs is not None:
                await self.fill_logprobs(obj, attempt)
            out = self.out.rewrite(obj)
            if out is None:
                continue
            n = len(out["choices"][0].get("token_ids") or []) if out["choices"] else 0
            if n:
                self.on_token()
                now = time.monotonic()
                self.metrics.itl.observe((now - self._last) / n)
                self._last = now
            self.sent = True
            yield sse_event(out)

    async def fix_cached_tokens(self, usage: Any, attempt: Attempt) -> None:
        """D's answer's usage (its body's, its stream's usage chunk) with P's prefix-cache
        hit as its cached prompt tokens (``proxy/cached_tokens.py``), where D reports them
        and P's answer says it; D alone (no P leg) computed the prompt: its own count."""
        if not isinstance(usage, dict) or attempt.p is None or not attempt.d.prompt_tokens_details:
            return
        p_body = await self._prefill_answer(attempt)
        cached = prefill_cached_tokens(p_body, usage.get("prompt_tokens"), self.request_id)
        if cached is not None:
            set_cached_tokens(usage, cached)

    async def fill_logprobs(self, body: dict[str, Any], attempt: Attempt) -> None:
        """Fill the log-prob entries D left null (what P computed) from P's answer; the
        body is D's answer, or the next chunk of D's stream."""
        try:
            logprobs = body["choices"][0].get("logprobs")
        except (KeyError, IndexError, TypeError, AttributeError):
            return
        chat = self.req.chat
        start, self._lp_seen = self._lp_seen, self._lp_seen + num_entries(logprobs, chat)
        if has_missing(logprobs, chat, start, echo=bool(self.req.parsed.echo)):
            source = await self._prefill_logprobs(attempt)
            if source is not None:
                fill_missing(logprobs, source, chat, start)

    async def _prefill_logprobs(self, attempt: Attempt) -> Any:
        """P's ``logprobs`` of ``attempt`` (None if it has no P leg or P's answer did not
        come: D's entries then stay null)."""
        with contextlib.suppress(KeyError, IndexError, TypeError, AttributeError):
            return (await self._prefill_answer(attempt))["choices"][0].get("logprobs")
        return None

    async def fill_prompt_logprobs(self, body: dict[str, Any], attempt: Attempt) -> None:
        """vLLM's ``prompt_logprobs`` (not streamed): D did not compute the prompt (its
        entries are null); P's answer has them, for the same prompt tokens."""
        where: Any = body if self.req.chat else (body.get("choices") or [{}])[0]
        mine = where.get("prompt_logprobs") if isinstance(where, dict) else None
        if not isinstance(mine, list) or any(e is not None for e in mine[1:]):
            return  # D computed them itself (it prefilled the prompt)
        with contextlib.suppress(KeyError, IndexError, TypeError, AttributeError):
            p_body = await self._prefill_answer(attempt)
            theirs = (p_body if self.req.chat else p_body["choices"][0])["prompt_logprobs"]
            if isinstance(theirs, list) and len(theirs) == len(mine):
                where["prompt_logprobs"] = theirs

    async def _prefill_answer(self, attempt: Attempt) -> Any:
        """P's answer of ``attempt`` (None if it has no P leg or the answer did not come)."""
        if self._p_answer is not None and self._p_answer[0] is attempt:
            return self._p_answer[1]
        task = getattr(attempt, "p_task", None)
        source = None
        if task is not None:
            # P's answer usually came before D's first token; else wait for it, up to
            # LOGPROBS_WAIT_S, and no longer once P is unreachable (a hung P never answers).
            p = attempt.p

            def stop() -> BaseException | None:
                return TimeoutError() if p is not None and p.unreachable else None

            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LOGPROBS_WAIT_S):
                    await wait_watched(task, stop, self.poll_s)
            if task.done() and not task.cancelled() and task.exception() is None:
                source = task.result()
            else:
                logger.warning(
                    "request %s: no prefill answer (its logprobs, cached tokens)", self.request_id
                )
        self._p_answer = (attempt, source)
        return source

    def close(self) -> None:
        """Close D's stream still held (the session ends)."""
        if self._events is not None:
            self._events.close()
            self._events = self._events_for = None
