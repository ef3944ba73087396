"""Asyncio front of the engine: a background thread runs ``EngineCore`` steps.

Callers (the HTTP server) use ``generate()``/``abort()`` from the event loop; requests
and aborts go to the engine thread through a queue, outputs come back through one
stream per request, bounded: outputs its reader has not taken yet are merged into one.
When the executor dies, every request ends with an error and ``healthy`` turns False.

Requests are checked against the engine in one place, the scheduler's ``add_request``
(request id in use, prompt empty or too long, blocks): a refusal comes back through the
request's own queue. A request's queue is registered for its id only once the
scheduler accepted it, on the engine thread, so a refused duplicate id never takes over
the stream of the request that holds the id.

Request ids are the engine's keys and must be unique; the HTTP layer makes one per request
(``<label>-<random>``) and passes the client's ``X-Request-Id`` as the request's ``label``,
so that two clients using one label never touch each other's request. ``abort_matching``
finds requests by engine id, label or transfer id (the ``/v1/abort`` endpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future, InvalidStateError
from typing import Any

from engine.config import EngineConfig
from engine.core.request import Request
from engine.engine_core import EngineCore
from engine.model.hub import resolve_model_config
from engine.outputs import RequestOutput
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.stats import StatsGroup
from engine.structured.compiler import copy_matcher
from engine.structured.matcher import GrammarState, is_rust_panic
from engine.tokenizer import load_tokenizer
from kvconnector.params import KVTransferParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
# A step that computed nothing (only waiting on transfers, holds, deadlines) is followed
# by a wait for a wake-up -- a new request or abort, a worker saying a transfer
# completed, a peer's message -- or this long (deadlines are checked every step).
EMPTY_STEP_WAIT_S = 0.05
# How a request that ended by itself ended, while its final output is not yet taken by its
# reader (``AsyncLLMEngine.abort``'s answer): at most this many kept, the oldest dropped (a
# reader that stops early without an abort leaves its entry).
MAX_UNREAD_ENDS = 4096
# ``abort`` waits this long for the engine thread's answer (a step, normally).
ABORT_ANSWER_TIMEOUT_S = 10.0


class _Stream:
    """Where one request's outputs go, read on ``loop``. Bounded: the engine thread never
    waits for the reader, and outputs the reader has not taken yet are merged into one
    (token ids appended, the latest state kept), so a slow reader -- a client reading its
    stream slowly -- leaves one pending output per request, not one per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """From any thread; nothing once the reader's loop is closed (no one reads)."""
        _call_soon(self.loop, self._put, item)

    def _put(self, item: RequestOutput | BaseException) -> None:
        tail = self._items[-1] if self._items else None
        if (
            isinstance(item, RequestOutput)
            and isinstance(tail, RequestOutput)
            and not tail.finished
        ):
            tail.merge(item)
        elif isinstance(item, RequestOutput):  # a copy: merging extends its lists
            self._items.append(item.copy())
        else:
            self._items.append(item)
        self._ready.set()

    @property
    def pending(self) -> int:
        """Items not yet taken by the reader."""
        return len(self._items)

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """``loop.call_soon_threadsafe``, but a closed loop (its caller gone, e.g. an
    ``asyncio.run`` that ended with a request still in the engine) is skipped: it must not
    end the engine thread."""
    with contextlib.suppress(RuntimeError):  # "Event loop is closed"
        loop.call_soon_threadsafe(fn, *args)


def _resolve(done: Future[Any], value: Any) -> None:
    """``done.set_result(value)`` unless its waiter gave up (cancelled it) already."""
    with contextlib.suppress(InvalidStateError):
        done.set_result(value)


def _put_each(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream._put(out)  # noqa: SLF001 - on the stream's loop, as put() would


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        config = resolve_model_config(config)  # a repo id becomes a local path, once
        self.config = config
        self.model_name = config.model.name
        self.tokenizer = load_tokenizer(config.model.model, config.model.chat_template)
        self.core = EngineCore(config, log_level, tokenizer=self.tokenizer)
        self.grammars = self.core.grammars  # the HTTP layer compiles into its cache
        self.max_model_len = self.core.max_model_len
        self.vocab_size = self.core.arch.vocab_size
        self.max_logprobs = self.core.max_logprobs
        self.dead_reason: str | None = None
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # accepted requests' output queues
        # Requests that ended by themselves, their final output delivered to a stream and
        # not yet taken by its reader: their finish reasons (under ``_streams_lock``).
        self._unread_ends: dict[str, str] = {}
        self._streams_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.core.set_wake(self._wake.set)
        self._stats: StatsGroup = self.core.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, config: EngineConfig, log_level: str = "INFO") -> AsyncLLMEngine:
        return cls(config, log_level)

    @property
    def healthy(self) -> bool:
        # A TP worker that died between steps marks the executor dead at once; say so
        # before a request has to fail on it.
        return self.dead_reason is None and not self.core.executor.is_dead

    @property
    def worker_pids(self) -> list[int]:
        return self.core.executor.pids

    # -- caller side (event loop) ----------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
        label: str | None = None,
        priority: int = 0,
        grammar: Any = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``grammar``: the compiled matcher of ``params.structured_output`` (the request
        gets a copy; without it the engine thread compiles, as offline callers do);
        ``cache_salt``: vLLM's, the request's prefix-cache isolation (``Request``)."""
        if not self.healthy:
            raise RuntimeError(f"engine is dead: {self.dead_reason}")
        stream = _Stream(asyncio.get_running_loop())
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            kv_transfer_params=kv_transfer_params,
            label=label,
            priority=priority,
            cache_salt=cache_salt,
        )
        if grammar is not None:
            so = params.structured_output
            assert so is not None  # a grammar is compiled from it
            req.grammar = GrammarState(
                copy_matcher(grammar, so), params.reasoning_tags, params.allowed_token_ids
            )
        self._post(("add", (req, stream)))
        if not self.healthy:  # died between the check above and the put
            raise RuntimeError(f"engine is dead: {self.dead_reason}")
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # refused or failed: nothing of ours to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if finished:
                self._unregister(request_id, stream, taken=True)
            else:  # the engine thread aborts the request if it is still ours
                self._post(("cancel", (request_id, stream)))

    async def abort(self, request_id: str, reason: str = "abort") -> str | None:
        """Abort the request whose engine id (the id given to ``generate``) is this.
        ``reason``: "abort", or "stop" when the caller ended it at a stop string (its
        finish reason in the request metrics, ``vllm:request_success_total``).

        With "abort", waits for the engine thread (a step at most) and returns the finish
        reason the request had ended with by itself before the abort reached it -- its
        final output not yet read by the caller (a client that went away as the request
        ended): the metrics count that one, not an abort -- or None when the abort ended
        it (or no such request was known). With "stop" (the caller knows how it ended),
        or a dead engine: None at once."""
        if reason != "abort" or not self.healthy or self._stop.is_set():
            self._post(("abort", (request_id, reason, None)))
            return None
        done: Future[str | None] = Future()
        self._post(("abort", (request_id, reason, done)))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), ABORT_ANSWER_TIMEOUT_S)
        except TimeoutError:
            logger.warning("request %s: no answer to its abort from the engine", request_id)
            return None

    async def settle(self, request_id: str, stop_string: bool) -> None:
        """The caller has the whole answer of ``request_id``, whose engine output said it
        finished, and checked stop strings on it (``SamplingParams.stop``): it ended at
        one (``stop_string``: counted as "stop"), or as the engine said."""
        self._post(("settle", (request_id, stop_string)))

    async def abort_matching(self, key: str, by: str = "request_id") -> list[str]:
        """Abort requests -- running, or finished with blocks held for a push -- and return
        their engine ids. ``by="request_id"``: the request whose engine id is ``key``, else
        every request labelled ``key``; ``by="transfer_id"``: every request of that
        transfer."""
        if by not in ("request_id", "transfer_id"):
            raise ValueError(f"cannot abort by {by!r}")
        if not self.healthy:
            return []
        done: Future[list[str]] = Future()
        self._post(("abort_matching", (key, by, done)))
        return await asyncio.wait_for(asyncio.wrap_future(done), timeout=30)

    def stats(self) -> StatsGroup:
        """The latest snapshot the engine thread took (typed, see ``engine.stats``)."""
        return self._stats

    def kv_info(self) -> dict[str, Any]:
        return self.core.connector.info()

    def histograms(self) -> dict[str, Any]:
        """Connector histograms by metric name (``engine.stats.Histogram`` with a ``doc``)."""
        return dict(getattr(self.core.connector, "histograms", {}))

    def _post(self, item: tuple[str, Any]) -> None:
        self._inbox.put(item)
        self._wake.set()

    def _unregister(self, request_id: str, stream: _Stream, taken: bool = False) -> bool:
        """Forget ``stream`` if it is still the one registered for ``request_id``;
        ``taken``: its reader took the final output (how it ended is known to it)."""
        with self._streams_lock:
            if self._streams.get(request_id) is not stream:
                return False
            del self._streams[request_id]
            if taken:
                self._unread_ends.pop(request_id, None)
            return True

    # -- engine thread -----------------------------------------------------------------------
    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Outputs (a step's, or the errors of a dying engine) to their streams in one
        hand-off per event loop (one wake-up of the loop per step, not one per request)."""
        with self._streams_lock:
            found = [(self._streams.get(o.request_id), o) for o in outputs]
            for stream, o in found:
                if o.finished and stream is not None:
                    self._note_end(o)
        pairs = [(s, o) for s, o in found if s is not None]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for stream, out in pairs:
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_each, items)

    def _note_end(self, out: RequestOutput) -> None:
        """(Under ``_streams_lock``.) ``out`` ends its request: how, until its reader takes it."""
        ends = self._unread_ends
        ends[out.request_id] = out.finish_reason or "stop"
        if len(ends) > MAX_UNREAD_ENDS:
            del ends[next(iter(ends))]

    def _abort(self, request_id: str, reason: str) -> str | None:
        """Abort ``request_id``; how it had ended by itself, if it had (``abort``)."""
        with self._streams_lock:
            ended = self._unread_ends.pop(request_id, None)
        self.core.abort_request(request_id, reason=reason)
        return ended

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                req, stream = payload
                try:
                    self.core.add_request(req)
                except InvalidRequestError as e:
                    stream.put(e)
                else:
                    with self._streams_lock:
                        self._streams[req.request_id] = stream
            elif kind == "cancel":  # the caller stopped reading before the request finished
                request_id, stream = payload
                if self._unregister(request_id, stream):
                    self.core.abort_request(request_id)
            elif kind == "abort":
                request_id, reason, answer = payload
                ended = self._abort(request_id, reason)
                if answer is not None:
                    _resolve(answer, ended)
            elif kind == "settle":
                request_id, stop_string = payload
                self.core.settle_request(request_id, stop_string)
            elif kind == "abort_matching":
                key, by, done = payload
                ids = self._matching(key, by)
                for rid in ids:
                    self.core.abort_request(rid)
                _resolve(done, ids)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _matching(self, key: str, by: str) -> list[str]:
        reqs = self.core.scheduler.requests  # running, waiting and held
        if by == "transfer_id":
            return [rid for rid, r in reqs.items() if r.transfer_id == key]
        if key in reqs:
            return [key]
        return [rid for rid, r in reqs.items() if r.label == key]

    def _run(self) -> None:
        """The engine thread. Whatever raises in it -- a step, or the bookkeeping around one
        -- makes the engine dead (``_die``): never a thread gone while requests wait. So
        does a Rust panic (pyo3's ``PanicException``: a ``BaseException``)."""
        try:
            while not self._stop.is_set():
                self._loop_once()
        except BaseException as e:
            if not (isinstance(e, Exception) or is_rust_panic(e)):
                raise
            logger.exception("the engine loop failed")
            self._die(f"{type(e).__name__}: {e}")
        else:  # shut down: no one waits on an answer the loop will never give
            self._refuse_inbox("the engine is shut down")

    def _loop_once(self) -> None:
        self._drain_inbox(block=not self.core.has_work())
        if not self.core.has_work():
            self._stats = self.core.stats()
            return
        outputs, num_tokens = self.core.step()
        self._deliver_step(outputs)
        self._stats = self.core.stats()
        if num_tokens == 0 and not self.core.has_running():
            # only waiting on transfers/holds (or a delayed admission's end); a request
            # whose KV landed in this step is running now: step again at once
            self._wake.wait(self.core.idle_wait(EMPTY_STEP_WAIT_S))
            self._wake.clear()

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("engine is dead: %s", reason)
        try:
            outputs = self.core.fail_all(f"engine failed: {reason}")
        except Exception:  # the scheduler's state is what failed: end the streams below
            logger.exception("ending the dead engine's requests failed")
            outputs = []
        self._deliver_step(outputs)
        ended = {o.request_id for o in outputs if o.finished}
        with self._streams_lock:
            left = [s for rid, s in self._streams.items() if rid not in ended]
        for stream in left:  # no output ended it: its reader must not wait for good
            stream.put(RuntimeError(f"engine is dead: {reason}"))
        # Requests still in the inbox, or added from now on, get the error too.
        self._refuse_inbox(f"engine is dead: {reason}")

    def _refuse_inbox(self, why: str) -> None:
        """Answer what waits in the inbox without the loop: requests fail with ``why``,
        aborts find nothing."""
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                payload[1].put(RuntimeError(why))
            elif kind == "abort_matching":
                _resolve(payload[2], [])
            elif kind == "abort" and payload[2] is not None:
                _resolve(payload[2], None)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.core.shutdown()
