"""UcxxTransport (``--kv-transport ucxx``) between two real processes with real ``ucxx``
workers, no mocks: the same checks as ``tests/test_nixl_transport.py`` (whole blocks, head
slices, notifications only after the data, a peer killed mid-write, a hung peer), plus
what the receiving side must refuse.

The test plays the prefill worker (P); a spawned child plays the decode worker (D) and
serves a small side-channel API so the test can read its KV cache and notifs.

These tests run in CI: ``ucxx`` is in the ``.[test]`` extra (for users it stays the
optional ``.[ucxx]`` extra). Without ``ucxx`` installed every test skips, saying so.
``PDSERVE_TEST_UCXX=0`` switches them off. The tests run in a child pytest process
(``@pytest.mark.isolated(batch=True)``, ``tests/isolated.py``; one child for the module,
a new one after a crash): a test builds ``ucxx`` workers and endpoints in its own
process, and ``ucxx`` was seen to segfault once closing an endpoint to a peer killed
mid-write (``test_write_to_killed_peer_errors_without_hanging``); a crash like that
fails that one test, with its signal and output, not the whole run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from transport_peer import block_bytes, peer_process, serve_peer

from engine.config import EngineConfig, KVTransferConfig, ModelConfig
from engine.kv_cache_layout import KVCacheSpec
from kvconnector.nixl.messages import Notif
from kvconnector.nixl.metadata import NixlConnectorMetadata
from kvconnector.nixl.side_channel import SideChannelClient
from kvconnector.nixl.transport_ucxx import UcxxTransport, ucxx_available
from kvconnector.nixl.worker import NixlConnectorWorker

if os.environ.get("PDSERVE_TEST_UCXX", "").strip().lower() in ("0", "false", "no", "off"):
    pytest.skip("ucxx tests switched off (PDSERVE_TEST_UCXX=0)", allow_module_level=True)
if not ucxx_available():
    pytest.skip(
        "ucxx is not installed (pip install -e '.[test]' or '.[ucxx]')",
        allow_module_level=True,
    )
# D is a spawned process; every transport has a UCX thread. Each test in a child pytest
# process: a segfault in ucxx fails that test, not the run (module docstring).
pytestmark = [pytest.mark.slow, pytest.mark.isolated(batch=True)]

SPEC = KVCacheSpec(
    num_blocks=32, num_layers=2, num_kv_heads=2, block_size=16, head_dim=32, dtype=torch.float16
)
TIMEOUT = 10.0


def _filled_cache(seed: int, spec: KVCacheSpec = SPEC) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(spec.shape, generator=gen).to(spec.torch_dtype)


def _decode_main(conn: Any, agent_name: str, spec: KVCacheSpec) -> None:
    """Child process: a D worker with a side channel for the test to drive it."""
    kv = _filled_cache(seed=1, spec=spec)
    transport = UcxxTransport(
        agent_name, kv, spec.block_bytes, num_layers=spec.num_layers, num_heads=spec.num_kv_heads
    )
    serve_peer(conn, transport, kv)


def _spec(heads: int = SPEC.num_kv_heads, block_size: int = SPEC.block_size) -> KVCacheSpec:
    return KVCacheSpec(
        num_blocks=SPEC.num_blocks,
        num_layers=SPEC.num_layers,
        num_kv_heads=heads,
        block_size=block_size,
        head_dim=SPEC.head_dim,
        dtype=SPEC.dtype,
    )


BIG = _spec(block_size=512)  # 256 KiB blocks: a whole-cache write is 8 MiB (rendezvous)


def decode_process(spec: KVCacheSpec = SPEC) -> contextlib.AbstractContextManager[Any]:
    """Start a D child; always stop it (by its handle) on exit, even on failure."""
    return peer_process(_decode_main, spec)


def _transport(name: str = "P", spec: KVCacheSpec = SPEC, seed: int = 0) -> UcxxTransport:
    return UcxxTransport(
        f"{name}-{uuid.uuid4().hex[:8]}",
        _filled_cache(seed, spec),
        spec.block_bytes,
        num_layers=spec.num_layers,
        num_heads=spec.num_kv_heads,
    )


@pytest.fixture
def prefill() -> Iterator[UcxxTransport]:
    transport = _transport()
    try:
        yield transport
    finally:
        transport.close()


def _wait(transport: UcxxTransport, handle: Any, limit: float = TIMEOUT) -> str:
    deadline = time.monotonic() + limit
    state = transport.poll(handle)
    while state == "pending" and time.monotonic() < deadline:
        time.sleep(0.001)
        state = transport.poll(handle)
    return state


def _connect(
    client: SideChannelClient, address: str, p: UcxxTransport, key: str, heads: Any = None
) -> dict[str, Any]:
    meta = client.request(address, {"op": "meta"}, TIMEOUT)["meta"]
    assert meta["library"] == "ucxx" and meta["mem_type"] == "DRAM"
    p.add_peer(key, meta, heads)
    return meta


def _notifs(client: SideChannelClient, address: str, n: int) -> list[bytes]:
    return client.request(address, {"op": "notifs", "n": n}, TIMEOUT + 5)["notifs"]


@pytest.mark.parametrize("ucx_tls", [None, "tcp"])
def test_write_blocks_end_to_end(ucx_tls: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if ucx_tls is not None:
        # Read by UCX when a context is created: applies to the child and to P below.
        monkeypatch.setenv("UCX_TLS", ucx_tls)
    p = _transport()
    client = SideChannelClient()
    try:
        with decode_process() as (_proc, _d_name, address):
            with pytest.raises(ValueError):  # block size mismatch is refused up front
                bad = client.request(address, {"op": "meta"}, TIMEOUT)["meta"]
                p.add_peer("bad", {**bad, "block_bytes": SPEC.block_bytes * 2})
            with pytest.raises(ValueError, match="nixl transport"):  # other library
                p.add_peer("nixl", {**bad, "library": "nixl"})
            meta = _connect(client, address, p, "d0")
            with pytest.raises(ValueError):  # one agent, one peer key
                p.add_peer("d0-again", meta)
            before = client.request(address, {"op": "blocks"}, TIMEOUT)["blocks"]
            src = [3, 4, 5, 9, 12, 13, 20, 21]
            dst = [0, 1, 2, 7, 20, 21, 30, 25]  # runs: 3 + 1 + 2 + (1 + 1): staged on P
            handle = p.write_blocks("d0", src, dst, b"req-1:done")
            assert handle.num_descriptors == 5
            assert handle.num_bytes == len(src) * SPEC.block_bytes
            # The notif comes only with the data in place (D copies it, then notifies).
            notifs = _notifs(client, address, 1)
            assert notifs == [b"req-1:done"]
            after = client.request(address, {"op": "blocks"}, TIMEOUT)["blocks"]
            assert _wait(p, handle) == "done", handle.error
            p.release(handle)
            src_bytes = block_bytes(_filled_cache(seed=0), src)
            for i in range(SPEC.num_blocks):
                if i in dst:
                    assert after[i] == src_bytes[dst.index(i)], f"block {i}"
                else:
                    assert after[i] == before[i], f"block {i} touched"

            # one run of whole blocks goes straight out of P's cache (no staging)
            one_run = p.write_blocks("d0", [10, 11, 12], [14, 15, 16], b"req-run")
            assert one_run.num_descriptors == 1
            assert _notifs(client, address, 2)[1:] == [b"req-run"]
            assert _wait(p, one_run) == "done", one_run.error
            p.release(one_run)
            after = client.request(address, {"op": "blocks"}, TIMEOUT)["blocks"]
            assert after[14:17] == block_bytes(_filled_cache(seed=0), [10, 11, 12])

            # data-less notification, and an empty write that only carries a notif
            assert p.send_notif("d0", b"abort:req-2")
            empty = p.write_blocks("d0", [], [], b"req-3:empty")
            assert _wait(p, empty) == "done" and empty.num_descriptors == 0
            notifs = _notifs(client, address, 4)
            assert notifs[2:] == [b"abort:req-2", b"req-3:empty"]

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

            assert p.stats.transfers_done == 3
            assert p.stats.bytes_written == (len(src) + 3) * SPEC.block_bytes
            assert p.stats.blocks_written == len(src) + 3
            assert p.stats.descriptors_total == 5 + 1
            assert p.stats.transfers_failed == 0
            with pytest.raises(ValueError):
                p.write_blocks("d0", [0], [SPEC.num_blocks], b"")
            with pytest.raises(KeyError):
                p.write_blocks("nope", [0], [0], b"")
            # re-adding a peer reconnects; writes keep working
            p.add_peer("d0", meta)
            again = p.write_blocks("d0", [1], [31], b"req-4")
            assert _notifs(client, address, 5)[4:] == [b"req-4"]
            assert _wait(p, again) == "done", again.error
            p.release(again)
            p.remove_peer("d0")
            assert not p.has_peer("d0")
    finally:
        p.close()


def test_head_slices_move_exactly_those_heads() -> None:
    """Heterogeneous TP: P ranks with 1 KV head write it into head 1 of D's 2 heads
    (another P rank would write head 0); D's head 0 and every other block stay as they were."""
    p_spec = _spec(1)
    p = _transport(spec=p_spec, seed=5)
    client = SideChannelClient()
    try:
        with decode_process(_spec(2)) as (_proc, _name, address):
            meta = client.request(address, {"op": "meta"}, TIMEOUT)["meta"]
            with pytest.raises(ValueError, match="out of"):
                p.add_peer("bad", meta, heads=(0, 2, 1))  # D has heads 0..1
            p.add_peer("d", meta, heads=(0, 1, 1))
            before = client.request(address, {"op": "blocks"}, TIMEOUT)["blocks"]
            handle = p.write_blocks("d", [1, 2, 7], [4, 0, 30], b"slices")
            assert handle.num_descriptors == 3 * SPEC.num_layers * 2  # (block, layer, kv)
            assert handle.num_bytes == 3 * SPEC.block_bytes // 2
            assert _notifs(client, address, 1) == [b"slices"]
            assert _wait(p, handle) == "done", handle.error
            after = client.request(address, {"op": "blocks"}, TIMEOUT)["blocks"]
            d_before = _as_kv(before, 2)
            d_after = _as_kv(after, 2)
            p_kv = _filled_cache(5, p_spec)
            expect = d_before.clone()
            for s, d in zip([1, 2, 7], [4, 0, 30], strict=True):
                expect[d, :, :, 1] = p_kv[s, :, :, 0]
            assert torch.equal(d_after, expect)
    finally:
        p.close()


def _as_kv(blocks: list[bytes], heads: int) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(b"".join(blocks)), dtype=torch.uint8)
    return raw.view(SPEC.torch_dtype).view(_spec(heads).shape)


def test_many_writes_in_flight_each_notify_after_their_data(prefill: UcxxTransport) -> None:
    """Writes posted back to back (P does not wait) all land, in order, notif by notif."""
    client = SideChannelClient()
    with decode_process() as (_proc, _name, address):
        _connect(client, address, prefill, "d0")
        handles = [
            prefill.write_blocks("d0", [i, i + 16], [31 - i, i], f"w{i}".encode())
            for i in range(12)
        ]
        assert _notifs(client, address, 12) == [f"w{i}".encode() for i in range(12)]
        for h in handles:
            assert _wait(prefill, h) == "done", h.error
            prefill.release(h)
        after = client.request(address, {"op": "blocks"}, TIMEOUT)["blocks"]
        src = block_bytes(_filled_cache(seed=0))
        for i in range(12):
            assert after[31 - i] == src[i] and after[i] == src[i + 16], i


@pytest.mark.parametrize("warm", [True, False], ids=["connected", "never-connected"])
def test_write_to_killed_peer_errors_without_hanging(warm: bool) -> None:
    """A write to a peer that died errors -- UCX's report, or its deadline (same-host
    shared memory does not notice a dead peer; a write small enough to go eagerly may even
    complete into its memory: these writes are 4 MiB, so D has to take them) -- and the
    peer is unusable afterwards."""
    client = SideChannelClient()
    prefill = _transport(spec=BIG)
    with prefill, decode_process(BIG) as (proc, _name, address):
        _connect(client, address, prefill, "d0")
        if warm:
            handle = prefill.write_blocks("d0", [0, 1], [0, 1], b"warm")
            assert _notifs(client, address, 1) == [b"warm"]
            assert _wait(prefill, handle) == "done"
            prefill.release(handle)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.monotonic()
        handle = prefill.write_blocks("d0", list(range(16)), list(range(16)), b"x", timeout_s=3.0)
        state = _wait(prefill, handle, limit=15.0)
        assert state == "error", handle
        assert time.monotonic() - t0 < 6.0
        prefill.release(handle)
        assert prefill.send_notif("d0", b"cancel") is False
        assert prefill.stats.transfers_failed == 1
        # the peer can be dropped and the transport stays usable
        prefill.remove_peer("d0")


def test_peer_killed_mid_write_errors_without_hanging() -> None:
    """D dies while a write to it is in flight (D has not taken the data yet): the write
    ends in "error" -- by UCX's failure report or at the latest by its deadline."""
    client = SideChannelClient()
    prefill = _transport(spec=BIG)
    with prefill, decode_process(BIG) as (proc, _name, address):
        _connect(client, address, prefill, "d0")
        handle = prefill.write_blocks("d0", list(range(32)), list(range(32)), b"x", timeout_s=5)
        assert prefill.poll(handle) == "pending"  # D takes the data only when it polls
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.monotonic()
        assert _wait(prefill, handle, limit=15.0) == "error", handle
        assert time.monotonic() - t0 < 6.0
        prefill.release(handle)  # unfinished: closes the endpoint
        later = prefill.write_blocks("d0", [0], [0], b"y")  # fails at once
        assert later.state == "error" and "closed" in (later.error or ""), later
        prefill.remove_peer("d0")


def test_write_to_hung_peer_times_out() -> None:
    """D stops (SIGSTOP) before it takes a write's data: the write errors at its deadline,
    releasing it cancels it (the endpoint is closed), and D re-added works again."""
    client = SideChannelClient()
    prefill = _transport(spec=BIG)
    with prefill, decode_process(BIG) as (proc, _name, address):
        meta = _connect(client, address, prefill, "d0")
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            handle = prefill.write_blocks(
                "d0", list(range(32)), list(range(32)), b"x", timeout_s=1.0
            )
            state = _wait(prefill, handle, limit=10.0)
            assert state == "error" and handle.error == "timeout", handle
            assert time.monotonic() - t0 < 5.0
            prefill.release(handle)  # unfinished: closes the endpoint, the peer is unusable
            assert prefill.poll(prefill.write_blocks("d0", [0], [0], b"y")) == "error"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        # Re-added (what the connector does when D handshakes again), it works again.
        prefill.add_peer("d0", meta)
        handle = prefill.write_blocks("d0", [2], [3], b"after")
        assert _wait(prefill, handle) == "done", handle.error
        # The timed-out write was cancelled on P; whether D had already taken it before
        # it stopped is UCX's timing (the worker fences a late notif by its nonce).
        notifs = _notifs(client, address, 1)
        assert notifs in ([b"after"], [b"x", b"after"]), notifs


# ------------------------------------------------------------------ D refuses bad input


class RawSender:
    """Sends hand-made messages to a UcxxTransport's worker (what a buggy peer could)."""

    def __init__(self, meta: dict[str, Any]) -> None:
        import ucxx._lib.libucxx as ucx
        from ucxx._lib.arr import Array

        self.ucx, self.Array = ucx, Array
        self.ctx = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self.worker = ucx.UCXWorker(self.ctx)
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=1)
        address = ucx.UCXAddress.create_from_buffer(meta["worker_address"])
        self.ep = self.worker.create_endpoint_from_worker_address(address, True)
        self.keep: list[Any] = []

    def send(self, tag: int, payload: bytes | np.ndarray) -> None:
        buf = np.frombuffer(payload, np.uint8) if isinstance(payload, bytes) else payload
        self.keep.append(buf)
        req = self.ep.tag_send(self.Array(buf), self.ucx.UCXXTag(tag))
        deadline = time.monotonic() + TIMEOUT
        while not req.completed and time.monotonic() < deadline:
            time.sleep(0.001)

    def close(self) -> None:
        self.worker.stop_progress_thread()


def _header(ids: list[int], nb: int, notif: bytes, heads: Any = None, age: float = 0) -> bytes:
    return msgpack.packb(
        {
            "v": 1,
            "a": "raw",
            "x": 1,
            "ts": time.time() - age,
            "n": notif,
            "nb": nb,
            "ids": ids,
            "h": heads,
        },
        use_bin_type=True,
    )


def _drain(d: UcxxTransport, want: int = 1, limit: float = 2.0) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + limit
    while len(got) < want and time.monotonic() < deadline:
        got += d.get_notifs()
        time.sleep(0.002)
    return got


def test_the_receiver_refuses_writes_outside_its_cache_and_notifies_only_good_ones() -> None:
    d_kv = _filled_cache(1)
    d = UcxxTransport(
        "D-raw", d_kv, SPEC.block_bytes, xfer_timeout_s=0.5, num_layers=2, num_heads=2
    )
    raw = RawSender(d.metadata())
    sentinel = d_kv.clone()
    block = np.full(SPEC.block_bytes, 7, np.uint8)
    try:
        bad = [
            _header([SPEC.num_blocks], SPEC.block_bytes, b"out-of-range"),
            _header([1, 1], 2 * SPEC.block_bytes, b"repeated"),
            _header([1], 2 * SPEC.block_bytes, b"wrong-size"),
            _header([1], SPEC.block_bytes // 2, b"bad-heads", heads=[1, 2]),
            b"\x93not a header",
        ]
        for i, h in enumerate(bad):
            raw.send(100 + i, h)
            raw.send(100 + i, block)
        raw.send(150, _header([3], SPEC.block_bytes, b"stale", age=60))  # sender gave up
        raw.send(150, block)
        raw.send(200, _header([1], SPEC.block_bytes, b"no-data"))  # the data never comes
        raw.send(300, _header([2], SPEC.block_bytes, b"short"))
        raw.send(300, block[:100])  # fewer bytes than announced
        assert _drain(d, limit=2.0) == []  # nothing good came; the header-only one expired
        assert torch.equal(d_kv, sentinel)  # and nothing was written
        raw.send(400, _header([5], SPEC.block_bytes, b"good"))
        raw.send(400, block)
        assert _drain(d) == [b"good"]
        assert torch.equal(d_kv[5].view(torch.uint8).reshape(-1), torch.from_numpy(block))
        assert not d._receiver.rx  # every refused write was dropped
    finally:
        raw.close()
        d.close()


def _decode_rank(timeout: float) -> tuple[NixlConnectorWorker, torch.Tensor]:
    """A real worker-side connector of a decode node on the UCXX transport (TP=1)."""
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
        kv_transfer=KVTransferConfig(
            kv_connector="nixl", kv_role="consumer", kv_transport="ucxx",
            kv_transfer_timeout=timeout,
        ),
    )  # fmt: skip
    kv = _filled_cache(1)
    w = NixlConnectorWorker(cfg, 0, 1)
    w.register_kv_caches(kv, SPEC)
    return w, kv


def _d_step(w: NixlConnectorWorker, md: NixlConnectorMetadata | None = None) -> set[str]:
    """One step of the decode rank (its metadata bound, then ``get_finished``)."""
    w.bind_connector_metadata(md or NixlConnectorMetadata())
    try:
        return w.get_finished(set())[1]
    finally:
        w.clear_connector_metadata()


def _steps_until(w: NixlConnectorWorker, want: str, limit: float = 3.0) -> set[str]:
    got: set[str] = set()
    deadline = time.monotonic() + limit
    while want not in got and time.monotonic() < deadline:
        got |= _d_step(w)
        time.sleep(0.002)
    return got


def test_a_stray_write_never_lands_in_blocks_its_notification_does_not_own(
    prefill: UcxxTransport,
) -> None:
    """D copies a UCXX write's data into its blocks itself. It used to copy first and let
    the worker check the nonce after: a stray or forged write -- naming a real
    reservation's nonce but another request's blocks, a nonce nobody reserved, or one of
    another D process -- overwrote the blocks of whatever request held them. The data
    now goes only into blocks of the reservation its notification names, on a rank that
    is still waiting for it; a write that came before the step naming its reservation
    waits for that step (the reservation goes to P while the step is on its way)."""
    w, d_kv = _decode_rank(timeout=1.0)
    try:
        assert w.transport is not None
        prefill.add_peer("d", w.transport.metadata())
        inc = "dinc"
        a, b = f"{inc}.1.aaaa", f"{inc}.2.bbbb"
        _d_step(w, NixlConnectorMetadata(incarnation=inc, watch=True, expect={a: [1, 2]}))
        sentinel = d_kv.clone()

        def write(local: list[int], remote: list[int], nonce: str) -> None:
            notif = Notif(r="R", t="t", k=nonce).pack()
            handle = prefill.write_blocks("d", local, remote, notif)
            assert _wait(prefill, handle) == "done", handle.error
            prefill.release(handle)

        write([5, 6], [5, 6], a)  # A's nonce, blocks that are not A's
        write([7], [7], f"{inc}.9.ffff")  # a nonce this D never reserved
        write([8], [8], "other.1.cccc")  # a nonce of another D process
        got = _steps_until(w, a, limit=2.5)  # past the 1 s transfer timeout
        assert got == set()
        assert torch.equal(d_kv, sentinel), "a stray write landed in D's blocks"
        assert not w.transport._receiver.rx  # every stray write was dropped

        write([5, 6], [5, 6], b)  # B's write comes before the step naming B
        assert _d_step(w) == set() and torch.equal(d_kv, sentinel)
        got = _d_step(w, NixlConnectorMetadata(expect={b: [5, 6]})) | _steps_until(w, b)
        assert got == {b}
        assert torch.equal(d_kv[5:7], prefill._kv_cache[5:7])

        write([1, 2], [1, 2], a)  # A's own write lands
        assert _steps_until(w, a) == {a}
        assert torch.equal(d_kv[1:3], prefill._kv_cache[1:3])
        assert torch.equal(d_kv[7:9], sentinel[7:9])
    finally:
        w.shutdown()


def test_pd_bench_transfer_measures_the_ucxx_connector_path(tmp_path) -> None:
    """``pd-bench transfer --kv-transport ucxx``: the connector path on UcxxTransport, next
    to raw NIXL and a copy, D's bytes checked (toy sizes; needs nixl too for the raw path)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("nixl._api")
    from harness import REPO_ROOT

    out = tmp_path / "transfer.json"
    toy = ["--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens", "40", "96"]
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "transfer", *toy, "--tp", "1", "2"]
        + ["--reps", "2", "--kv-transport", "ucxx", "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "connector on ucxx" in proc.stdout
    report = json.loads(out.read_text())
    assert report["kv_transport"] == "ucxx" and report["all_data_ok"] is True
    for row in report["results"]:
        assert row["data"]["connector"]["ok"] and row["data"]["connector"]["blocks_checked"]
