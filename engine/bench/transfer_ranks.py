"""``pd-bench transfer``'s ranks: the KV geometry, the data pattern and its check, and the
P and D rank processes the bench drives (``RankProcs``).

Every P and D rank is its own process, forked from the engine's fork server as its TP
workers are (``engine.worker.pipe.worker_context``: torch imported once), holding one
rank's cache, the connector's transport on it (``NixlTransport`` or ``UcxxTransport``) and
a raw NIXL agent; the bench (``engine/bench/transfer.py``) sends them ops over a pipe
(connect, send, expect, zero, check, read, close) and reads their ``perf_counter`` times.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
START_LEAD_S = 0.02  # how far ahead of "now" the ranks of one side are told to start
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constant, as a signed int64


class BenchError(RuntimeError):
    """A rank failed, timed out, or the data check could not run."""


# ---------------------------------------------------------------------------------------
# geometry and the data pattern (pure)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """The KV geometry of the whole model (all TP ranks)."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token, all layers, K and V, all heads (all ranks together)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def heads_per_rank(self, tp: int) -> int:
        if tp < 1 or self.kv_heads % tp:
            raise ValueError(f"--tp {tp} must divide --kv-heads {self.kv_heads}")
        return self.kv_heads // tp

    def block_bytes(self, tp: int) -> int:
        """Bytes of one block of one rank."""
        return self.bytes_per_token * self.block_size // tp

    def rank_shape(self, tp: int, num_blocks: int) -> tuple[int, ...]:
        """One rank's cache, ``engine/kv_cache_layout.py``'s layout."""
        return (
            num_blocks,
            self.layers,
            2,
            self.heads_per_rank(tp),
            self.block_size,
            self.head_dim,
        )


def _salt(seed: int, rank: int) -> int:
    return ((seed * 1_000_003 + rank * 7919 + 1) * _MIX) & 0x7FFF_FFFF_FFFF


def fill_pattern(block: Any, seed: int, rank: int, block_id: int) -> None:
    """Fill one block (a contiguous tensor, any dtype and device) with the bytes only
    ``(seed, rank, block_id)`` produce: int64 words ``(k + offset) * odd + salt``."""
    import torch

    flat = block.view(-1).view(torch.uint8)
    if flat.numel() % 8:
        gen = torch.Generator(device=flat.device).manual_seed(_salt(seed, rank) + block_id * 65_537)
        flat.random_(0, 256, generator=gen)
        return
    words = flat.view(torch.int64)
    n = words.numel()
    torch.arange(block_id * n, (block_id + 1) * n, dtype=torch.int64, out=words)
    words.mul_(_MIX).add_(_salt(seed, rank))


def _bytes(t: Any) -> Any:
    """``t``'s bytes (the pattern makes NaNs, and NaN != NaN: compare bytes, not values)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def check_blocks(
    cache: Any, dst_ids: list[int], src_ids: list[int], seed: int, rank: int
) -> dict[str, Any]:
    """Does ``cache[dst_ids[k]]`` hold P's block ``src_ids[k]`` (its pattern), and is
    every other block still zero?"""
    import torch

    expected = torch.empty_like(cache[0])
    wrong = []
    for k, (dst, src) in enumerate(zip(dst_ids, src_ids, strict=True)):
        fill_pattern(expected, seed, rank, src)
        if not torch.equal(_bytes(cache[dst]), _bytes(expected)):
            wrong.append(k)
    touched = set(dst_ids)
    others = [b for b in range(cache.shape[0]) if b not in touched]
    dirty = 0
    for start in range(0, len(others), 64):
        idx = torch.tensor(others[start : start + 64], device=cache.device)
        flat = cache.index_select(0, idx).view(len(idx), -1).view(torch.uint8)
        dirty += int(flat.ne(0).any(dim=1).sum())
    return {
        "blocks": len(dst_ids),
        "wrong_blocks": len(wrong),
        "first_wrong": wrong[:5],
        "dirty_other_blocks": dirty,
        "ok": not wrong and dirty == 0,
    }


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def timed_copy(dst: Any, src: Any) -> tuple[float, float]:
    """``dst.copy_(src)`` and, on CUDA, a synchronize: (start, end) on ``perf_counter``."""
    _sync(src.device)
    t0 = time.perf_counter()
    dst.copy_(src)
    _sync(src.device)
    return t0, time.perf_counter()


def rank_device(device: str, rank: int) -> str:
    """Where rank ``rank`` of either side keeps its cache: ``cpu``, or ``cuda:rank % gpus``
    (on one GPU P and D share it, as gpu_check's P/D nodes do)."""
    if device == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise BenchError("--device cuda: CUDA is not available")
    return f"cuda:{rank % torch.cuda.device_count()}"


# ---------------------------------------------------------------------------------------
# one rank (a child process)
# ---------------------------------------------------------------------------------------


class _Rank:
    """State of one P or D rank: its cache, its connector transport, its raw agent."""

    def __init__(self, role: str, rank: int, cfg: dict[str, Any]) -> None:
        import torch

        from kvconnector.nixl.transport import NixlTransport

        if not os.environ.get("NIXL_LOG_LEVEL"):  # nixl logs an INFO line per agent on stdout
            logging.getLogger("nixl").setLevel(logging.WARNING)
        torch.set_num_threads(cfg["copy_threads"])
        self.role, self.rank, self.cfg = role, rank, cfg
        geo = Geometry(**cfg["geometry"])
        tp, pool = cfg["tp"], cfg["pool_blocks"]
        self.device = torch.device(rank_device(cfg["device"], rank))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dtype = getattr(torch, geo.dtype)
        self.block_bytes = geo.block_bytes(tp)
        self.cache = torch.zeros(geo.rank_shape(tp, pool), dtype=dtype, device=self.device)
        self.scratch = None
        if role == "P":
            for b in range(pool):
                fill_pattern(self.cache[b], cfg["seed"], rank, b)
            self.scratch = torch.zeros_like(self.cache)  # the copy path's target
        _sync(self.device)
        tag = f"{cfg['run_id']}-{role}{rank}"
        make: Any = NixlTransport
        if cfg.get("kv_transport") == "ucxx":  # --kv-transport ucxx: the connector's UCXX path
            from kvconnector.nixl.transport_ucxx import UcxxTransport as make
        self.transport = make(
            f"pdbench-{tag}", self.cache, self.block_bytes, xfer_timeout_s=cfg["timeout"]
        )
        from nixl._api import nixl_agent, nixl_agent_config

        self.raw = nixl_agent(f"pdbench-raw-{tag}", nixl_agent_config(backends=["UCX"]))
        self.raw_reg = self.raw.register_memory(self.cache)
        self.raw_peer: str | None = None
        self.raw_peer_base = 0
        self.raw_peer_dev = 0
        self.raw_xfer: Any = None
        self.raw_xfer_blocks = 0
        self.mem_type = self.transport.mem_type
        self.dev_id = self.transport.device_id
        self.poll_s = cfg["poll_us"] / 1e6

    # -- setup

    def meta(self) -> dict[str, Any]:
        return {
            "transport": self.transport.metadata(),
            "raw": {
                "agent_metadata": self.raw.get_agent_metadata(),
                "base_addr": int(self.cache.data_ptr()),
                "device_id": self.dev_id,
            },
        }

    def connect(self, peer: dict[str, Any]) -> None:
        self.transport.add_peer("D", peer["transport"])
        name = self.raw.add_remote_agent(peer["raw"]["agent_metadata"])
        self.raw_peer = name.decode() if isinstance(name, bytes) else str(name)
        self.raw_peer_base = int(peer["raw"]["base_addr"])
        self.raw_peer_dev = int(peer["raw"]["device_id"])

    def prepare_raw(self, n: int) -> None:
        """One request, one descriptor each side: blocks 0..n-1 -> the peer's 0..n-1."""
        if self.raw_xfer is not None:
            self.raw.release_xfer_handle(self.raw_xfer)
            self.raw_xfer = None
        size = n * self.block_bytes
        local = self.raw.get_xfer_descs(
            [(int(self.cache.data_ptr()), size, self.dev_id)], self.mem_type
        )
        remote = self.raw.get_xfer_descs(
            [(self.raw_peer_base, size, self.raw_peer_dev)], self.mem_type
        )
        self.raw_xfer = self.raw.initialize_xfer("WRITE", local, remote, self.raw_peer, b"")
        self.raw_xfer_blocks = n

    # -- P: one measured send

    def send(self, msg: dict[str, Any]) -> dict[str, Any]:
        path, n, notif = msg["path"], msg["n"], msg["tag"].encode()
        if path == "raw" and self.raw_xfer_blocks != n:
            raise BenchError(f"raw request prepared for {self.raw_xfer_blocks} blocks, not {n}")
        _wait_until(msg["t0"])
        if path == "copy":
            t_issue, t_done = timed_copy(self.scratch[:n], self.cache[:n])
            return {"t_issue": t_issue, "t_done": t_done}
        if path == "connector":
            t_issue = time.perf_counter()
            handle = self.transport.write_blocks("D", list(range(n)), msg["dst"], notif)
            state = self.transport.poll(handle)
            while state == "pending":
                time.sleep(self.poll_s)
                state = self.transport.poll(handle)
            t_done = time.perf_counter()
            descs = handle.num_descriptors
            self.transport.release(handle)
            if state != "done":
                raise BenchError(f"connector WRITE failed: {handle.error}")
            return {"t_issue": t_issue, "t_done": t_done, "descriptors": descs}
        if path == "raw":
            deadline = time.perf_counter() + self.cfg["timeout"]
            t_issue = time.perf_counter()
            state = self.raw.transfer(self.raw_xfer, notif)
            while state == "PROC":
                if time.perf_counter() > deadline:
                    raise BenchError("raw NIXL WRITE timed out")
                time.sleep(self.poll_s)
                state = self.raw.check_xfer_state(self.raw_xfer)
            t_done = time.perf_counter()
            if state != "DONE":
                raise BenchError(f"raw NIXL WRITE ended in state {state}")
            return {"t_issue": t_issue, "t_done": t_done, "descriptors": 1}
        raise BenchError(f"unknown path {path!r}")

    # -- D: wait for one notification

    def expect(self, msg: dict[str, Any], conn: Any) -> dict[str, Any]:
        want = msg["tag"].encode()
        if msg["path"] == "connector":
            get = self.transport.get_notifs
        else:

            def get() -> list[bytes]:
                return [m for ms in self.raw.get_new_notifs().values() for m in ms]

        deadline = time.perf_counter() + self.cfg["timeout"]
        others = 0
        while True:
            notifs = get()
            now = time.perf_counter()
            if want in notifs:
                return {"t_arrival": now, "other_notifs": others + len(notifs) - 1}
            others += len(notifs)
            if now > deadline:
                raise BenchError(f"notification {msg['tag']} did not arrive in time")
            if conn.poll(0):  # the bench gave up on this one (a P rank failed)
                conn.recv()
                return {"aborted": True}
            time.sleep(self.poll_s)

    # -- data checks

    def check(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.role == "P":  # the copy path: the target holds exactly the source
            import torch

            n = msg["n"]
            ok = bool(torch.equal(_bytes(self.scratch[:n]), _bytes(self.cache[:n])))
            return {"blocks": n, "ok": ok, "wrong_blocks": 0 if ok else -1}
        return check_blocks(self.cache, msg["dst"], msg["src"], self.cfg["seed"], self.rank)

    def read(self, ids: list[int]) -> list[bytes]:
        """The bytes of blocks ``ids`` of the cache (for tests, at toy sizes)."""
        return [_bytes(self.cache[i]).cpu().numpy().tobytes() for i in ids]

    def zero(self) -> None:
        target = self.scratch if self.role == "P" else self.cache
        target.zero_()
        _sync(self.device)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.raw_xfer is not None:
                self.raw.release_xfer_handle(self.raw_xfer)
            if self.raw_peer is not None:
                self.raw.remove_remote_agent(self.raw_peer)
            self.raw.deregister_memory(self.raw_reg)
        self.transport.close()


def _wait_until(t0: float) -> None:
    """Sleep, then spin, until ``perf_counter() >= t0``."""
    left = t0 - time.perf_counter()
    if left > 0.002:
        time.sleep(left - 0.002)
    while time.perf_counter() < t0:
        pass


def _rank_main(conn: Any, role: str, rank: int, cfg: dict[str, Any]) -> None:
    """A rank's process: one rank, driven by the bench over ``conn`` until "close"."""
    logging.basicConfig(level=logging.WARNING)
    try:
        state = _Rank(role, rank, cfg)
    except BaseException as e:  # the bench reads the reason instead of a dead pipe
        conn.send({"error": f"{role}{rank} start: {e!r}"})
        return
    conn.send({"meta": state.meta()})
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return  # the bench went away
            op = msg["op"]
            try:
                if op == "close":
                    conn.send({"ok": True})
                    return
                if op == "connect":
                    state.connect(msg["peer"])
                    reply: dict[str, Any] = {"ok": True}
                elif op == "prepare_raw":
                    state.prepare_raw(msg["n"])
                    reply = {"ok": True}
                elif op == "send":
                    reply = state.send(msg)
                elif op == "expect":
                    reply = state.expect(msg, conn)
                elif op == "zero":
                    state.zero()
                    reply = {"ok": True}
                elif op == "check":
                    reply = state.check(msg)
                elif op == "read":
                    reply = {"blocks": state.read(msg["ids"])}
                elif op == "abort":
                    reply = {"aborted": True}
                else:
                    reply = {"error": f"unknown op {op!r}"}
            except Exception as e:
                reply = {"error": f"{role}{rank} {op}: {e}"}
            conn.send(reply)
    finally:
        state.close()


# ---------------------------------------------------------------------------------------
# the ranks as the bench sees them (parent process)
# ---------------------------------------------------------------------------------------


class RankProcs:
    """TP P ranks and TP D ranks as child processes; always stopped by their handles."""

    def __init__(self, cfg: dict[str, Any], start_timeout: float = 120.0) -> None:
        from engine.worker.pipe import run_in_environment, worker_context

        ctx = worker_context()  # forked from a fork server that imported torch once
        env = dict(os.environ)
        self.tp = cfg["tp"]
        self.timeout = cfg["timeout"] + 30.0
        self.procs: dict[str, list[tuple[Any, Any]]] = {"P": [], "D": []}
        try:
            for role in ("D", "P"):
                for rank in range(self.tp):
                    parent, child = ctx.Pipe()
                    proc = ctx.Process(
                        target=run_in_environment,
                        args=(env, _rank_main, child, role, rank, cfg),
                        daemon=True,
                    )
                    proc.start()
                    child.close()
                    self.procs[role].append((proc, parent))
            metas = {role: self._recv_all(role, start_timeout, what="start") for role in ("P", "D")}
            for rank in range(self.tp):
                self._send("P", rank, {"op": "connect", "peer": metas["D"][rank]["meta"]})
            self._recv_all("P", self.timeout, what="connect")
        except BaseException:
            self.close()
            raise

    def _send(self, role: str, rank: int, msg: dict[str, Any]) -> None:
        self.procs[role][rank][1].send(msg)

    def send_all(self, role: str, msg: dict[str, Any]) -> None:
        for rank in range(self.tp):
            self._send(role, rank, msg)

    def _recv_all(self, role: str, timeout: float, what: str) -> list[dict[str, Any]]:
        replies, errors = [], []
        deadline = time.monotonic() + timeout
        for rank, (proc, conn) in enumerate(self.procs[role]):
            while not conn.poll(0.2):
                if not proc.is_alive():
                    raise BenchError(f"{role}{rank} exited ({proc.exitcode}) during {what}")
                if time.monotonic() > deadline:
                    raise BenchError(f"{role}{rank} did not answer {what} in {timeout:.0f} s")
            reply = conn.recv()
            if "error" in reply:
                errors.append(reply["error"])
            replies.append(reply)
        if errors:
            raise BenchError("; ".join(errors))
        return replies

    def call_all(self, role: str, msg: dict[str, Any]) -> list[dict[str, Any]]:
        self.send_all(role, msg)
        return self._recv_all(role, self.timeout, what=msg["op"])

    def measure(self, path: str, n: int, dst: list[int], tag: str) -> dict[str, Any]:
        """One transfer of ``n`` blocks per rank along ``path``; seconds and descriptors."""
        if path != "copy":
            self.send_all("D", {"op": "expect", "path": path, "tag": tag})
        t0 = time.perf_counter() + START_LEAD_S
        msg = {"op": "send", "path": path, "n": n, "dst": dst, "tag": tag, "t0": t0}
        try:
            sent = self.call_all("P", msg)
        except BaseException:
            if path != "copy":  # D ranks still wait for the notification: release them
                with contextlib.suppress(Exception):
                    self.send_all("D", {"op": "abort"})
                    self._recv_all("D", self.timeout, what="abort")
            raise
        start = min(r["t_issue"] for r in sent)
        if path == "copy":
            end = max(r["t_done"] for r in sent)
        else:
            got = self._recv_all("D", self.timeout, what=f"{path} notification")
            end = max(r["t_arrival"] for r in got)
        return {
            "seconds": end - start,
            "descriptors": [r.get("descriptors", 0) for r in sent],
            "p_done_s": max(r["t_done"] for r in sent) - start,
        }

    def close(self) -> None:
        for role in ("P", "D"):
            for proc, conn in self.procs[role]:
                with contextlib.suppress(Exception):
                    if proc.is_alive():
                        conn.send({"op": "close"})
        for role in ("P", "D"):
            for proc, conn in self.procs[role]:
                proc.join(15)
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)
                conn.close()
        self.procs = {"P": [], "D": []}
