"""A streamed answer's body, from its first bytes to ``[DONE]``: D's stream relayed, and
what a failure of D does to it.

``StreamBody`` is the second half of a streamed ``Session`` (``proxy/session.py`` runs
the pairs: it found the stream's first bytes, ``start_stream``, and launches every rerun
this module asks for). It yields P's first chunk when P's first token was pre-streamed,
then D's stream through ``DecodeRelay`` (``proxy/decode_relay.py``), and always ends
with ``[DONE]``:

* D's stream failing before any of it reached the client (its connection broken or
  given up, an end without ``[DONE]``, its error event unless the client's 4xx:
  ``DecodeRelay.relay``) reruns the request (``--max-retries``): on a pair that agrees
  on P's first token when that was streamed (``Session.rerun_after_first_token``: the
  same first token, always so for greedy or seeded sampling, else ``retry_diverged``),
  else on any route (``Session.rerun_whole``).
* Once some of it did, a failure ends the stream with ``data: {"error": ...}`` and
  ``data: [DONE]``: never a silently truncated answer; unless ``--migration-limit``
  allows moving the stream: another pair (or D alone) reruns the request with the seed
  the failed one drew from, the proxy checks the replayed tokens against what the client
  has and drops them (``ClientStream``), and the stream goes on -- not for ``echo``, tool
  calls or reasoning (``Session.shaped_by_d``), nor after the answer's ``finish_reason``
  was sent. Moves are counted in ``Session.migrations`` and, by how the stream ended, in
  ``pdproxy_stream_migrations_total``.
* D's error event after its tokens is handled as D's stream breaking there (moved, or
  the stream ended as below; D leaves the rotation unless it was load), but for the
  client's 4xx: forwarded as the stream's last event (the session's outcome "error").
  A failure the proxy cannot rerun or move, and a fault of
  the proxy's own, end it with the proxy's error event; a node's answer for the client
  (``PassThrough``: a refusal, or load with no node left) with that answer's error.
* The stream's end read (``[DONE]``): D's connection drained for reuse (bounded by
  ``--health-timeout``), the attempt finished, and the router told what D now caches.

The session is closed when the body ends, however it ends (the client gone included).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from engine.httpkit.sse import SSE_DONE, sse_event
from engine.server.request_fields import APIError, error_body
from proxy.client_stream import Diverged
from proxy.decode_events import DecodeEvents
from proxy.legs import UpstreamError
from proxy.node_client import NodeHTTPError
from proxy.retries import PassThrough

if TYPE_CHECKING:
    from proxy.session import Session

logger = logging.getLogger(__name__)


class StreamBody:
    def __init__(self, session: Session) -> None:
        """``session``: a streamed session whose ``start_stream`` returned."""
        self.s = session

    async def events(self) -> AsyncIterator[str]:
        """The SSE body; always ends with [DONE], and closes the session."""
        s = self.s
        s.relay.tokens_sent()
        try:
            if s.first_chunk is not None:
                yield s.first_chunk
                s.relay.tokens_sent()
            s.out.decode_starts()
            assert s.current is not None
            try:
                await s.current.wait_decode()
            except UpstreamError as e:
                tid = s.current.transfer_id
                s.retries.failed(s.current, e)
                if s.out.sent_ids is None:
                    await s.rerun_whole(tid)
                else:
                    await s.rerun_after_first_token()
            while True:
                assert s.current is not None
                events = s.relay.events_of(s.current)
                s.relay.restart()
                try:
                    async for chunk in s.relay.relay(events, s.current):
                        if s.relay.d_error:  # D's own error event, the relay's last
                            s.outcome = "error"
                        yield chunk
                    if not events.done and s.outcome != "error":
                        raise UpstreamError(s.current.d, "the decode stream ended without [DONE]")
                    break
                except (UpstreamError, NodeHTTPError) as e:
                    migrating = s.relay.sent or s.out.has_decode_part
                    if migrating and (
                        s.out.finished
                        or s.migrations >= s.cfg.migration_limit
                        or s.shaped_by_d  # echo, tool calls, reasoning (Session.__init__)
                    ):
                        raise  # the answer was whole but for [DONE], or no move is left
                    await self._rerun(e, migrating)
            if s.relay.d_error:
                # D's own error event ended the stream (never "ok", whatever followed it).
                if s.migrations:
                    s.metrics.migrations.labels("failed").inc()
            elif events.done:
                await self._done(events)
            yield SSE_DONE
        except (UpstreamError, APIError, PassThrough, NodeHTTPError, ValueError) as e:
            yield self._failed(e)
            yield SSE_DONE
        except Exception:  # a fault of the proxy's own: the client still gets an end
            logger.exception("request %s: the stream failed", s.request_id)
            s.stream_error.count()
            if s.migrations and s.outcome != "ok":  # "ok": counted as resumed
                s.metrics.migrations.labels("failed").inc()
            s.outcome = "error"
            yield sse_event(error_body("internal error in the proxy", "server_error", None))
            yield SSE_DONE
        finally:
            s.close()

    async def _rerun(self, err: UpstreamError | NodeHTTPError, migrating: bool) -> None:
        """D's stream failed (``err``) and may go on: rerun the request (nothing of D's
        stream reached the client) or move the stream (``migrating``), on a pair that
        agrees on P's streamed first token, else on any route; raises when ``Retries``
        allows no other attempt."""
        s = self.s
        assert s.current is not None
        whole = s.out.sent_ids is None  # D's stream is the whole answer
        if isinstance(err, NodeHTTPError):
            err = UpstreamError(s.current.d, f"decode stream broke: {err}")
        tid = s.current.transfer_id
        tokens = s.out.decode_tokens + len(s.out.sent_ids or ())
        # Raises when no other node may take it (load with none left): then the stream
        # did not move, and no migration is counted.
        s.retries.failed(s.current, err, migrating=migrating)
        if migrating:
            s.migrations += 1
            logger.warning(
                "request %s: %s after %d tokens; moving the stream to another "
                "pair (migration %d of %d)", s.request_id, err, tokens,
                s.migrations, s.cfg.migration_limit,
            )  # fmt: skip
        else:
            logger.info("request %s: %s before its first token; rerunning", s.request_id, err)
        s.out.decode_starts()
        launched = s.retries.attempts
        try:
            if whole:
                await s.rerun_whole(tid)
            else:
                await s.rerun_after_first_token()
        except (APIError, PassThrough):
            if migrating and s.retries.attempts == launched:
                s.migrations -= 1  # no pair was left to move to: the stream did not move
            raise

    async def _done(self, events: DecodeEvents) -> None:
        """D's stream ended with [DONE]: the answer is the client's whole."""
        s = self.s
        assert s.current is not None
        # The last chunk: the connection stays reusable. Its wait is bounded (the answer
        # is whole: a D hanging now only costs the connection).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(s.cfg.health_timeout):
                await events.resp.drain()
        events.resp.close()
        s.current.finished = True
        s.current.d.mark_answered()
        s.outcome = "ok"
        if s.migrations:
            s.metrics.migrations.labels("resumed").inc()
        if s.keeps_answer:
            s.answered(*s.out.answer(), s.out.answer_calls, s.out.reasoned)

    def _failed(
        self, err: UpstreamError | APIError | PassThrough | NodeHTTPError | ValueError
    ) -> str:
        """The stream ends with the proxy's error event for ``err`` (the node that failed
        leaves the rotation). A node's answer for the client (``PassThrough``: its refusal
        of the request, or load with no node left) ends it with the error that answer's
        body carries, as before the headers (there with its status): load stays load
        (``overloaded``, to retry later), never an ``upstream_error``."""
        s = self.s
        if isinstance(err, UpstreamError) and err.node_fault:
            err.mark_failed()
        elif isinstance(err, NodeHTTPError) and s.current is not None:
            s.current.d.mark_failed(f"decode stream broke: {err}")
        logger.warning("request %s failed mid-stream: %s", s.request_id, err)
        s.stream_error.count()
        if s.migrations:
            outcome = "diverged" if isinstance(err, Diverged) else "failed"
            s.metrics.migrations.labels(outcome).inc()
        s.outcome = "error"
        if isinstance(err, PassThrough):
            return sse_event(err.body)
        if isinstance(err, UpstreamError) and err.overloaded and err.body is not None:
            return sse_event(err.body)  # D's load event mid-answer, no move left
        msg = err.message if isinstance(err, APIError) else f"upstream failure: {err}"
        code = err.code if isinstance(err, APIError) and err.code else "upstream_error"
        return sse_event(error_body(msg, "server_error", None, code))
