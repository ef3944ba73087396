"""Asyncio front of the engine: a background thread runs ``EngineCore`` steps.

Callers (the HTTP server) use ``generate()``/``abort()`` from the event loop; requests
and aborts go to the engine thread through a queue, outputs come back through one
asyncio queue per request. When the executor dies, every request ends with an error
and ``healthy`` turns False.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from engine.config import EngineConfig
from engine.core.request import Request
from engine.engine_core import EngineCore
from engine.outputs import RequestOutput
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.tokenizer import load_tokenizer
from kvconnector.params import KVTransferParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
EMPTY_STEP_SLEEP_S = 0.001


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        self.config = config
        self.model_name = config.model.name
        self.tokenizer = load_tokenizer(config.model.model)
        self.core = EngineCore(config, log_level)
        self.max_model_len = self.core.max_model_len
        self.vocab_size = self.core.arch.vocab_size
        self.dead_reason: str | None = None
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._stop = threading.Event()
        self._stats: dict[str, float] = self.core.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, config: EngineConfig, log_level: str = "INFO") -> AsyncLLMEngine:
        return cls(config, log_level)

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

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
    ) -> AsyncIterator[RequestOutput]:
        if not self.healthy:
            raise RuntimeError(f"engine is dead: {self.dead_reason}")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's maximum "
                f"context length is {self.max_model_len} tokens",
                "prompt",
            )
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is in use", "request_id")
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            kv_transfer_params=kv_transfer_params,
        )
        self._inbox.put(("add", req))
        finished = False
        if not self.healthy:  # died between the check above and the put
            with self._streams_lock:
                self._streams.pop(request_id, None)
            raise RuntimeError(f"engine is dead: {self.dead_reason}")
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True  # refused or failed: nothing of ours to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    def kv_info(self) -> dict[str, Any]:
        return self.core.connector.info()

    def histograms(self) -> dict[str, Any]:
        """Connector histograms by metric name (``kvconnector.nixl.histogram.Histogram``)."""
        return dict(getattr(self.core.connector, "histograms", {}))

    # -- engine thread -----------------------------------------------------------------------
    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        with self._streams_lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                try:
                    self.core.add_request(payload)
                except InvalidRequestError as e:
                    self._deliver(e, payload.request_id)
            elif kind == "abort":
                self.core.abort_request(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_inbox(block=not self.core.has_work())
                if not self.core.has_work():
                    self._stats = self.core.stats()
                    continue
                outputs, num_tokens = self.core.step()
            except Exception as e:
                self._die(f"{type(e).__name__}: {e}")
                return
            for out in outputs:
                self._deliver(out, out.request_id)
            self._stats = self.core.stats()
            if num_tokens == 0:
                time.sleep(EMPTY_STEP_SLEEP_S)  # only waiting on transfers/holds

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("engine is dead: %s", reason)
        for out in self.core.fail_all(f"engine failed: {reason}"):
            self._deliver(out, out.request_id)
        # Requests still in the inbox, or added from now on, get the error too.
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._deliver(RuntimeError(f"engine is dead: {reason}"), payload.request_id)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.core.shutdown()
