"""NixlTransport between two real processes with real NIXL (UCX) agents, no mocks.

The test process plays the prefill worker (P); a spawned child plays the decode worker
(D) and serves a small side-channel API so the test can read its KV cache and notifs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transport_peer import block_bytes, peer_process, serve_peer

from engine.kv_cache_layout import KVCacheSpec
from kvconnector.nixl.side_channel import SideChannelClient

nixl_transport = pytest.importorskip("kvconnector.nixl.transport")
if not nixl_transport.NIXL_AVAILABLE:
    pytest.skip("nixl not installed", allow_module_level=True)
NixlTransport = nixl_transport.NixlTransport
pytestmark = pytest.mark.slow  # D is a spawned process

SPEC = KVCacheSpec(
    num_blocks=32, num_layers=2, num_kv_heads=2, block_size=16, head_dim=32, dtype=torch.float16
)
TIMEOUT = 10.0


def _filled_cache(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SPEC.shape, generator=gen).to(SPEC.torch_dtype)


def _decode_main(conn: Any, agent_name: str) -> None:
    """Child process: a D worker with a side channel for the test to drive it."""
    kv = _filled_cache(seed=1)
    serve_peer(conn, NixlTransport(agent_name, kv, SPEC.block_bytes), kv)


def decode_process() -> contextlib.AbstractContextManager[tuple[Any, str, str]]:
    """Start a D child; always stop it (by its handle) on exit, even on failure."""
    return peer_process(_decode_main)


@pytest.fixture
def prefill() -> Iterator[NixlTransport]:
    transport = NixlTransport(
        f"P-{uuid.uuid4().hex[:8]}", _filled_cache(seed=0), SPEC.block_bytes, telemetry=True
    )
    try:
        yield transport
    finally:
        transport.close()


def _wait(transport: NixlTransport, handle: Any, limit: float = TIMEOUT) -> str:
    deadline = time.monotonic() + limit
    state = transport.poll(handle)
    while state == "pending" and time.monotonic() < deadline:
        time.sleep(0.001)
        state = transport.poll(handle)
    return state


def _connect(client: SideChannelClient, address: str, p: NixlTransport, key: str) -> dict[str, Any]:
    meta = client.request(address, {"op": "meta"}, TIMEOUT)["meta"]
    assert meta["block_bytes"] == SPEC.block_bytes and meta["mem_type"] == "DRAM"
    p.add_peer(key, meta)
    return meta


@pytest.mark.parametrize("ucx_tls", [None, "tcp"])
def test_write_blocks_end_to_end(
    prefill: NixlTransport, ucx_tls: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if ucx_tls is not None:
        # Read by UCX when an agent is created: applies to the child and to P below.
        monkeypatch.setenv("UCX_TLS", ucx_tls)
        p = NixlTransport(f"Ptcp-{uuid.uuid4().hex[:8]}", _filled_cache(0), SPEC.block_bytes)
    else:
        p = prefill
    client = SideChannelClient()
    try:
        with decode_process() as (_proc, _d_name, address):
            with pytest.raises(ValueError):  # block size mismatch is refused up front
                bad = client.request(address, {"op": "meta"}, TIMEOUT)["meta"]
                p.add_peer("bad", {**bad, "block_bytes": SPEC.block_bytes * 2})
            meta = _connect(client, address, p, "d0")
            with pytest.raises(ValueError):  # one agent, one peer key
                p.add_peer("d0-again", meta)
            before = client.request(address, {"op": "blocks"}, TIMEOUT)["blocks"]
            src = [3, 4, 5, 9, 12, 13, 20, 21]
            dst = [0, 1, 2, 7, 20, 21, 30, 25]  # runs: 3 + 1 + 2 + (1 + 1)
            handle = p.write_blocks("d0", src, dst, b"req-1:done")
            assert handle.num_descriptors == 5
            assert handle.num_bytes == len(src) * SPEC.block_bytes
            assert _wait(p, handle) == "done", handle.error
            if p is prefill:  # telemetry on: NIXL merged exactly our runs
                assert handle.nixl_desc_count == handle.num_descriptors
            p.release(handle)

            # D never loaded P's metadata, yet it receives the notification.
            notifs = client.request(address, {"op": "notifs", "n": 1}, TIMEOUT)["notifs"]
            assert notifs == [b"req-1:done"]
            after = client.request(address, {"op": "blocks"}, TIMEOUT)["blocks"]
            src_bytes = block_bytes(_filled_cache(seed=0), src)
            for i in range(SPEC.num_blocks):
                if i in dst:
                    assert after[i] == src_bytes[dst.index(i)], f"block {i}"
                else:
                    assert after[i] == before[i], f"block {i} touched"

            # data-less notification, and an empty write that only carries a notif
            assert p.send_notif("d0", b"abort:req-2")
            empty = p.write_blocks("d0", [], [], b"req-3:empty")
            assert p.poll(empty) == "done" and empty.num_descriptors == 0
            notifs = client.request(address, {"op": "notifs", "n": 3}, TIMEOUT)["notifs"]
            assert notifs[1:] == [b"abort:req-2", b"req-3:empty"]

            # reverse direction: D needs P's metadata to notify P
            reply = client.request(
                address, {"op": "add_peer", "key": "p0", "meta": p.metadata()}, TIMEOUT
            )
            assert reply["ok"], reply
            assert client.request(
                address, {"op": "send_notif", "key": "p0", "msg": b"from-d"}, TIMEOUT
            )["ok"]
            got: list[bytes] = []
            deadline = time.monotonic() + TIMEOUT
            while not got and time.monotonic() < deadline:
                got = p.get_notifs()
                time.sleep(0.005)
            assert got == [b"from-d"]

            assert p.stats.transfers_done == 2
            assert p.stats.bytes_written == len(src) * SPEC.block_bytes
            assert p.stats.descriptors_total == 5
            with pytest.raises(ValueError):
                p.write_blocks("d0", [0], [SPEC.num_blocks], b"")
            with pytest.raises(KeyError):
                p.write_blocks("nope", [0], [0], b"")
            # re-adding a peer re-prepares its descriptors; writes keep working
            p.add_peer("d0", meta)
            again = p.write_blocks("d0", [1], [31], b"req-4")
            assert _wait(p, again) == "done", again.error
            p.release(again)
            p.remove_peer("d0")
            assert not p.has_peer("d0")
    finally:
        if p is not prefill:
            p.close()


@pytest.mark.parametrize("warm", [True, False], ids=["connected", "never-connected"])
def test_write_to_killed_peer_errors_without_hanging(prefill: NixlTransport, warm: bool) -> None:
    client = SideChannelClient()
    with decode_process() as (proc, _name, address):
        _connect(client, address, prefill, "d0")
        if warm:
            handle = prefill.write_blocks("d0", [0, 1], [0, 1], b"warm")
            assert _wait(prefill, handle) == "done"
            prefill.release(handle)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.monotonic()
        handle = prefill.write_blocks("d0", list(range(16)), list(range(16)), b"x", timeout_s=5.0)
        state = _wait(prefill, handle, limit=15.0)
        assert state == "error", handle
        assert time.monotonic() - t0 < 5.0 + 5  # by the deadline (slack for a loaded box)
        prefill.release(handle)
        assert prefill.send_notif("d0", b"cancel") is False
        assert prefill.stats.transfers_failed == 1
        # the peer can be dropped and the transport stays usable
        prefill.remove_peer("d0")


def test_write_to_hung_peer_times_out(prefill: NixlTransport) -> None:
    client = SideChannelClient()
    with decode_process() as (proc, _name, address):
        _connect(client, address, prefill, "d0")
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            handle = prefill.write_blocks(
                "d0", list(range(32)), list(range(32)), b"x", timeout_s=1.0
            )
            state = _wait(prefill, handle, limit=10.0)
            assert state in ("done", "error")  # never stuck in "pending"
            if state == "error":
                assert handle.error == "timeout"
            assert time.monotonic() - t0 < 5.0
            prefill.release(handle)  # cancels a still-running request
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
