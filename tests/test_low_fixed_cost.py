"""Low fixed cost (issue 10): while an engine only waits on transfers, its workers watch
them between steps and wake the engine when one completes; the engine does not send them
empty steps on a timer (it used to, every ~1 ms, competing with P's prefill for cores)."""

from __future__ import annotations

import time

import pytest
import zmq
from fakes import NotifsOnly
from harness import free_port

from engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from engine.core.request import Request
from engine.engine_core import WORKER_POLL_FALLBACK_S, EngineCore
from engine.sampling_params import SamplingParams
from kvconnector.nixl.messages import Notif
from kvconnector.nixl.metadata import NixlConnectorMetadata
from kvconnector.nixl.worker import NixlConnectorWorker
from kvconnector.params import KVTransferParams


def test_a_worker_told_to_watch_finds_landed_kv_between_steps():
    cfg = EngineConfig(kv_transfer=KVTransferConfig(kv_connector="nixl", kv_role="consumer"))
    w = NixlConnectorWorker(cfg, 0, 1)
    w.transport = NotifsOnly()  # type: ignore[assignment]
    assert not w.watching()
    w.bind_connector_metadata(NixlConnectorMetadata(watch=True))
    assert w.get_finished(set()) == (set(), set())
    w.clear_connector_metadata()
    assert w.watching()  # remembered after the step
    assert not w.progress()  # nothing yet
    w.transport.inbox.append(Notif(r="X", t="t", k="n1").pack())  # type: ignore[union-attr]
    assert w.progress()  # -> the worker process wakes the engine
    assert w.get_finished(set()) == (set(), {"n1"})  # the next step reports it
    w.bind_connector_metadata(NixlConnectorMetadata(watch=False))
    w.get_finished(set())
    assert not w.watching()


@pytest.mark.slow
def test_an_engine_waiting_for_kv_sends_its_workers_no_step_per_loop():
    """A decode engine whose prefill peer never answers: its request waits for KV. Driving
    the step loop as fast as it goes for a while, the workers get a step only at the
    fallback cadence (they would wake the engine if the KV landed); before, every loop
    sent them one."""
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{free_port()}"
    silent.bind(address)
    cfg = EngineConfig(
        model=ModelConfig(model="tiny"),
        cache=CacheConfig(num_blocks=64),
        kv_transfer=KVTransferConfig(
            kv_connector="nixl", kv_role="consumer", kv_transfer_timeout=60, peer_ping_interval=0
        ),
    )
    core = EngineCore(cfg)
    try:
        params = KVTransferParams(
            do_remote_prefill=True, transfer_id="t", remote_side_channel=address
        )
        core.add_request(
            Request(
                "r", list(range(1, 40)), SamplingParams(max_tokens=2), kv_transfer_params=params
            )
        )
        core.step()  # admitted: blocks reserved, waiting for KV
        assert core.connector.needs_worker_poll()
        dispatched = 0
        real = core.executor.execute_model

        def counting(*args, **kwargs):
            nonlocal dispatched
            dispatched += 1
            return real(*args, **kwargs)

        core.executor.execute_model = counting  # type: ignore[method-assign]
        loops, start = 0, time.monotonic()
        while time.monotonic() - start < 0.5:
            core.step()
            loops += 1
        elapsed = time.monotonic() - start
        assert loops > 20, "the loop itself was too slow to tell"
        assert dispatched <= 2 + elapsed / WORKER_POLL_FALLBACK_S, (dispatched, loops)
    finally:
        core.shutdown()
        silent.close(linger=0)
        ctx.term()


class _ScriptedCore:
    """The engine loop's view of an engine: step 1 computes nothing but lands a request's KV
    (it is running now), step 2 decodes it, then there is no work."""

    def __init__(self, stop) -> None:
        self.steps, self.stop = 0, stop

    def has_work(self) -> bool:
        if self.steps >= 2:
            self.stop.set()  # ends the loop
        return self.steps < 2

    def has_running(self) -> bool:
        return self.steps == 1  # after the landing step

    def step(self):
        self.steps += 1
        return [], (0 if self.steps == 1 else 1)

    def stats(self):
        return None

    def idle_wait(self, longest: float) -> float:
        return longest


class _RecordingEvent:
    def __init__(self, loop) -> None:
        self.loop, self.waits = loop, []

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.loop._stop.set()  # one idle wait is all this test needs to see
        return False

    def clear(self) -> None:
        pass


def test_a_request_whose_kv_landed_is_decoded_at_once_not_after_the_idle_wait():
    """The step that sees KV land computes nothing (the request becomes runnable in it);
    the loop must step again at once, not wait out the 50 ms idle timeout first (it did:
    the first token after P's was ~55 ms late through the proxy)."""
    import queue
    import threading

    from engine.async_engine import AsyncLLMEngine

    loop = AsyncLLMEngine.__new__(AsyncLLMEngine)
    loop._stop = threading.Event()
    loop.core = _ScriptedCore(loop._stop)  # type: ignore[assignment]
    loop._inbox = queue.Queue()
    loop._wake = _RecordingEvent(loop)  # type: ignore[assignment]
    loop._streams, loop._streams_lock = {}, threading.Lock()
    loop._run()
    # Both steps ran without an idle wait between them.
    assert loop.core.steps == 2
    assert loop._wake.waits == []
