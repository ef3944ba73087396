"""``pd-bench transfer``: the connector's P->D KV push next to raw NIXL and a local copy.

For one KV geometry (default Llama-3-8B: 32 layers, 8 KV heads x head_dim 128, bfloat16,
block size 16 -> 128 KiB of KV per token over all ranks) and each TP size and prompt
length asked for, one run measures side by side, on the same processes and memory:

``connector``
    What the NIXL connector's P workers do: each P rank's ``NixlTransport``
    (``kvconnector/nixl/transport.py``) WRITEs the prompt's blocks of its
    ``[block, layer, kv, head, token, dim]`` cache (rank r holds KV heads
    ``r * H/tp .. (r + 1) * H/tp``) into blocks the same-rank D process reserved, with a
    notification. P's blocks are ``0 .. n-1`` (a fresh pool); D's come from a free list
    (``--dst-blocks``: ``shuffled`` by default, so most blocks are their own descriptor).
    Timed from the first rank issuing its WRITE (``make_prepped_xfer`` + ``transfer``)
    to the notification having arrived at every D rank. ``--kv-transport ucxx``: the same
    on ``UcxxTransport`` (``kvconnector/nixl/transport_ucxx.py``) instead.
``raw``
    Plain NIXL moving the same bytes: a second agent per process, registered on the same
    caches, one prepared request per rank whose only descriptor is P's blocks
    ``0 .. n-1`` -> D's blocks ``0 .. n-1`` as one region, re-posted with a fresh
    notification each time. Timed the same way, from ``transfer`` to the last D rank's
    notification (the request is built before the clock starts).
``copy``
    The same bytes copied inside each P process (``Tensor.copy_``: memcpy on CPU,
    device-to-device on CUDA, then a synchronize), all ranks at once. Timed from the first
    rank's start to the last rank's end.

Every P and D rank is its own spawned process (as the engine's TP workers are); rank r of P
pushes to rank r of D. The ranks of one side start together: the bench hands them a start
time a few ms ahead on ``time.perf_counter`` (``CLOCK_MONOTONIC``, one clock for all
processes of a host). D polls for notifications every ``--poll-us``.

After the timed rounds, each path is run once more into zeroed memory and checked byte for
byte: D's reserved blocks hold exactly what P's blocks hold (P fills block ``i`` of rank r
with a pattern only ``(seed, r, i)`` produces; D recomputes it per block), and no other D
block was written. ``data`` in the table says whether all three checks passed.

Memory: each side allocates only the largest size asked for, per rank -- P a cache and a
copy target, D a cache -- 3 x tokens x bytes/token in all (3 GiB at 8k tokens, the
default maximum), whatever the TP. On CPU the bench refuses to start when that exceeds
75% of the available memory.

    pd-bench transfer                                  # 128 512 2048 8192 tokens, TP 1 and 2
    pd-bench transfer --tokens 2048 --tp 2 --json t.json --plot t.png
    pd-bench transfer --device cuda                    # VRAM (all ranks on cuda:rank % gpus)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from engine.bench.stats import _json_float

PATHS = ("connector", "raw", "copy")
DST_LAYOUTS = ("shuffled", "runs", "contiguous")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
START_LEAD_S = 0.02  # how far ahead of "now" the ranks of one side are told to start
RUN_MAX = 16  # longest free-list run of --dst-blocks runs
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constant, as a signed int64


class BenchError(RuntimeError):
    """A rank failed, timed out, or the data check could not run."""


# ---------------------------------------------------------------------------------------
# geometry and block ids (pure)
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


def num_blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def dst_block_ids(n: int, pool: int, layout: str, seed: int) -> list[int]:
    """The ``n`` block ids a D with ``pool`` free blocks reserves, in prompt order.

    ``contiguous``: ``0 .. n-1`` (a fresh pool). ``runs``: the pool cut into runs of 1 to
    16 consecutive blocks, the runs shuffled (a free list after some churn). ``shuffled``:
    ``n`` distinct blocks in random order (the worst case: nearly every block its own run).
    """
    if not 0 <= n <= pool:
        raise ValueError(f"{n} blocks do not fit a pool of {pool}")
    rng = random.Random(seed)
    if layout == "contiguous":
        return list(range(n))
    if layout == "shuffled":
        return rng.sample(range(pool), n)
    if layout == "runs":
        runs: list[list[int]] = []
        start = 0
        while start < pool:
            length = min(rng.randint(1, RUN_MAX), pool - start)
            runs.append(list(range(start, start + length)))
            start += length
        rng.shuffle(runs)
        return [b for run in runs for b in run][:n]
    raise ValueError(f"--dst-blocks must be one of {DST_LAYOUTS}, got {layout!r}")


def count_runs(dst_ids: list[int]) -> int:
    """Descriptors a WRITE from blocks ``0 .. n-1`` into ``dst_ids`` needs (NIXL merges
    pairs contiguous on both sides)."""
    from kvconnector.nixl.block_runs import block_runs

    return len(block_runs(list(range(len(dst_ids))), dst_ids))


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
# one rank (a spawned process)
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
    """Spawned process: one rank, driven by the bench over ``conn`` until "close"."""
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
# the bench (parent process)
# ---------------------------------------------------------------------------------------


class RankProcs:
    """TP P ranks and TP D ranks as spawned processes; always stopped by their handles."""

    def __init__(self, cfg: dict[str, Any], start_timeout: float = 120.0) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.tp = cfg["tp"]
        self.timeout = cfg["timeout"] + 30.0
        self.procs: dict[str, list[tuple[Any, Any]]] = {"P": [], "D": []}
        try:
            for role in ("D", "P"):
                for rank in range(self.tp):
                    parent, child = ctx.Pipe()
                    proc = ctx.Process(
                        target=_rank_main, args=(child, role, rank, cfg), daemon=True
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


def path_stats(times: list[float], nbytes: int) -> dict[str, Any]:
    med = statistics.median(times)
    return {
        "times_s": times,
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "gbps": nbytes / med / 1e9,
        "gbps_best": nbytes / min(times) / 1e9,
    }


def bench_tp(
    geo: Geometry,
    tp: int,
    tokens_list: list[int],
    args: argparse.Namespace,
    log: Any = print,
) -> list[dict[str, Any]]:
    """Every size for one TP: processes up once, all three paths per round, then checks."""
    geo.heads_per_rank(tp)
    sizes = [(t, num_blocks_for(t, geo.block_size)) for t in tokens_list]
    pool = max(n for _, n in sizes)
    cfg = {
        "geometry": asdict(geo),
        "tp": tp,
        "pool_blocks": pool,
        "device": args.device,
        "seed": args.seed,
        "timeout": args.timeout,
        "poll_us": args.poll_us,
        "copy_threads": args.copy_threads,
        "kv_transport": args.kv_transport,
        "run_id": uuid.uuid4().hex[:8],
    }
    results = []
    procs = RankProcs(cfg)
    counter = 0
    try:
        for tokens, n in sizes:
            dst = dst_block_ids(n, pool, args.dst_blocks, seed=args.seed * 7919 + tokens)
            procs.call_all("P", {"op": "prepare_raw", "n": n})
            nbytes = n * geo.block_bytes(tp) * tp
            times: dict[str, list[float]] = {p: [] for p in PATHS}
            descs: list[int] = []
            p_done: list[float] = []
            for rnd in range(args.warmup + args.reps):
                order = PATHS[rnd % 3 :] + PATHS[: rnd % 3]  # no path always goes first
                for path in order:
                    counter += 1
                    m = procs.measure(path, n, dst, tag=f"pdbench {path} {counter}")
                    if rnd >= args.warmup:
                        times[path].append(m["seconds"])
                        if path == "connector":
                            descs = m["descriptors"]
                            p_done.append(m["p_done_s"])
            data = verify(procs, n, dst, counter) if args.verify else None
            row = {
                "tp": tp,
                "tokens": tokens,
                "blocks_per_rank": n,
                "bytes_per_rank": n * geo.block_bytes(tp),
                "bytes_total": nbytes,
                "dst_runs": count_runs(dst),
                "descriptors_per_rank": descs,
                "paths": {p: path_stats(times[p], nbytes) for p in PATHS},
                "connector_p_done_median_s": statistics.median(p_done),
                "data": data,
            }
            paths = row["paths"]
            row["ratio_connector_raw"] = paths["connector"]["gbps"] / paths["raw"]["gbps"]
            row["ratio_connector_copy"] = paths["connector"]["gbps"] / paths["copy"]["gbps"]
            row["data_ok"] = None if data is None else all(d["ok"] for d in data.values())
            results.append(row)
            log(format_row_line(row))
    finally:
        procs.close()
    return results


def verify(procs: RankProcs, n: int, dst: list[int], counter: int) -> dict[str, Any]:
    """Each path once more into zeroed memory; the receiving side checks every byte."""
    out: dict[str, Any] = {}
    for path, d_ids in (("connector", dst), ("raw", list(range(n)))):
        procs.call_all("D", {"op": "zero"})
        procs.measure(path, n, dst, tag=f"pdbench check {path} {counter}")
        checks = procs.call_all("D", {"op": "check", "dst": d_ids, "src": list(range(n))})
        out[path] = _merge_checks(checks)
    procs.call_all("P", {"op": "zero"})
    procs.measure("copy", n, dst, tag="copy")
    out["copy"] = _merge_checks(procs.call_all("P", {"op": "check", "n": n}))
    return out


def _merge_checks(checks: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "ok": all(c["ok"] for c in checks),
        "blocks_checked": sum(c["blocks"] for c in checks),
        "wrong_blocks": sum(max(c.get("wrong_blocks", 0), 0) for c in checks),
        "dirty_other_blocks": sum(c.get("dirty_other_blocks", 0) for c in checks),
        "per_rank": checks,
    }


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------


def format_row_line(row: dict[str, Any]) -> str:
    p = row["paths"]
    return (
        f"tp {row['tp']} {row['tokens']:>6} tokens: connector {p['connector']['gbps']:.2f} "
        f"GB/s, raw {p['raw']['gbps']:.2f}, copy {p['copy']['gbps']:.2f} "
        f"(connector/raw {row['ratio_connector_raw']:.2f}, "
        f"connector/copy {row['ratio_connector_copy']:.2f}), data "
        f"{_data_word(row['data_ok'])}"
    )


def _mib(nbytes: int) -> str:
    mib = nbytes / 2**20
    return f"{mib:,.0f}" if mib >= 10 else f"{mib:.2f}"


def _data_word(ok: bool | None) -> str:
    return "unchecked" if ok is None else ("ok" if ok else "WRONG")


def markdown_table(results: list[dict[str, Any]]) -> str:
    head = (
        "| TP | tokens | MiB | descs/rank | connector ms | connector GB/s | raw ms | raw GB/s "
        "| copy ms | copy GB/s | connector/raw | connector/copy | data |"
    )
    lines = [head, "|" + "---:|" * 12 + "---|"]
    for r in results:
        p = r["paths"]
        descs = r["descriptors_per_rank"]
        lines.append(
            f"| {r['tp']} | {r['tokens']} | {_mib(r['bytes_total'])} "
            f"| {max(descs) if descs else 0} "
            f"| {p['connector']['median_s'] * 1e3:.2f} | {p['connector']['gbps']:.2f} "
            f"| {p['raw']['median_s'] * 1e3:.2f} | {p['raw']['gbps']:.2f} "
            f"| {p['copy']['median_s'] * 1e3:.2f} | {p['copy']['gbps']:.2f} "
            f"| {r['ratio_connector_raw']:.2f} | {r['ratio_connector_copy']:.2f} "
            f"| {_data_word(r['data_ok'])} |"
        )
    return "\n".join(lines)


def plot_transfer(report: dict[str, Any], path: str) -> bool:
    """GB/s (median) against prompt tokens, one line per TP and path: color by path,
    line style by TP. False (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed; not writing {path}")
        return False
    results = report["results"]
    colors = {"connector": "tab:blue", "raw": "tab:orange", "copy": "tab:green"}
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(8, 5))
    for k, tp in enumerate(sorted({r["tp"] for r in results})):
        rows = sorted((r for r in results if r["tp"] == tp), key=lambda r: r["tokens"])
        xs = [r["tokens"] for r in rows]
        for path_name in PATHS:
            ys = [r["paths"][path_name]["gbps"] for r in rows]
            ax.plot(
                xs,
                ys,
                marker="o",
                color=colors[path_name],
                linestyle=styles[k % len(styles)],
                label=f"TP {tp} {path_name}",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["tokens"] for r in results})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("GB/s (median; GB = 1e9 bytes; log scale)")
    geo = report.get("geometry") or {}
    kib = (report.get("bytes_per_token") or 0) / 1024
    ax.set_title(
        f"pd-bench transfer: {report.get('memory', '?')}, {geo.get('layers')} layers, "
        f"{kib:g} KiB/token, connector on {report.get('kv_transport', 'nixl')}, "
        f"commit {report.get('commit')}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, handlelength=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def memory_needed(geo: Geometry, tokens_list: list[int]) -> int:
    """Bytes all ranks of one TP hold at once: P cache + P copy target + D cache."""
    blocks = max(num_blocks_for(t, geo.block_size) for t in tokens_list)
    return 3 * blocks * geo.block_size * geo.bytes_per_token


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def add_transfer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("geometry (default: Llama-3-8B, 128 KiB of KV per token)")
    g.add_argument("--layers", type=int, default=32, help="layers (default: 32)")
    g.add_argument("--kv-heads", type=int, default=8, help="KV heads, all ranks (default: 8)")
    g.add_argument("--head-dim", type=int, default=128, help="head dim (default: 128)")
    g.add_argument(
        "--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16", help="(default: bfloat16)"
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per block (default: 16)")
    w = p.add_argument_group("what to measure")
    w.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[128, 512, 2048, 8192],
        help="prompt lengths to push (default: 128 512 2048 8192)",
    )
    w.add_argument(
        "--tp",
        type=int,
        nargs="+",
        default=[1, 2],
        help="TP sizes, each rank holding its share of the KV heads (default: 1 2)",
    )
    w.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the caches live: cpu (DRAM) or cuda (VRAM, rank r on cuda:r %% gpus)",
    )
    w.add_argument(
        "--dst-blocks",
        choices=DST_LAYOUTS,
        default="shuffled",
        help="how D's reserved blocks lie: shuffled free list (default), shuffled runs of "
        "1-16 blocks, or contiguous",
    )
    w.add_argument("--reps", type=int, default=5, help="measured rounds (default: 5)")
    w.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default: 1)")
    w.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check D's bytes after each path (default: on)",
    )
    w.add_argument("--seed", type=int, default=0, help="data and block-order seed (default: 0)")
    w.add_argument(
        "--poll-us",
        type=float,
        default=50.0,
        help="sleep between polls for completion/notifications, microseconds (default: 50)",
    )
    w.add_argument(
        "--copy-threads",
        type=int,
        default=1,
        help="torch threads per rank process (the CPU copy path's memcpy; default: 1)",
    )
    w.add_argument(
        "--timeout", type=float, default=60.0, help="per-transfer deadline, s (default: 60)"
    )
    w.add_argument(
        "--kv-transport",
        choices=["nixl", "ucxx"],
        default="nixl",
        help="the connector path's transport, as the nodes' flag (default: nixl; ucxx needs "
        "pip install -e '.[ucxx]'); raw and copy are unchanged",
    )
    w.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    w.add_argument(
        "--plot",
        metavar="PATH.png",
        help="GB/s against tokens, one line per TP and path (matplotlib)",
    )


def validate(args: argparse.Namespace) -> Geometry:
    """The geometry, or ``ValueError`` naming the flag."""
    geo = Geometry(args.layers, args.kv_heads, args.head_dim, args.dtype, args.block_size)
    if any(t < 1 for t in args.tokens):
        raise ValueError("--tokens must all be >= 1")
    for tp in args.tp:
        geo.heads_per_rank(tp)
    if args.reps < 1 or args.warmup < 0:
        raise ValueError("--reps must be >= 1 and --warmup >= 0")
    if args.poll_us < 0 or args.timeout <= 0 or args.copy_threads < 1:
        raise ValueError("--poll-us >= 0, --timeout > 0 and --copy-threads >= 1 required")
    return geo


def run_transfer(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        geo = validate(args)
    except ValueError as e:
        parser.error(str(e))
    tokens = sorted(set(args.tokens))
    need = memory_needed(geo, tokens)
    avail = _mem_available()
    if args.device == "cpu" and avail is not None and need > 0.75 * avail:
        print(
            f"pd-bench transfer: needs {need / 2**30:.1f} GiB of memory, only "
            f"{avail / 2**30:.1f} GiB available; ask for fewer --tokens",
            file=sys.stderr,
        )
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("pd-bench transfer: --device cuda but CUDA is not available", file=sys.stderr)
            return 2
    from kvconnector.nixl.transport import NIXL_AVAILABLE

    if not NIXL_AVAILABLE:
        print("pd-bench transfer: nixl is not installed (pip install nixl)", file=sys.stderr)
        return 2
    if args.kv_transport == "ucxx" and importlib.util.find_spec("ucxx") is None:
        print(
            "pd-bench transfer: ucxx is not installed (pip install -e '.[ucxx]')", file=sys.stderr
        )
        return 2
    memory = "VRAM" if args.device == "cuda" else "DRAM"
    print(
        f"pd-bench transfer: {geo.layers} layers x {geo.kv_heads} KV heads x head_dim "
        f"{geo.head_dim}, {geo.dtype}, block {geo.block_size} -> "
        f"{geo.bytes_per_token / 1024:g} KiB/token; {memory}; D blocks {args.dst_blocks}; "
        f"connector on {args.kv_transport}; "
        f"median of {args.reps} (+{args.warmup} warm-up); peak memory {need / 2**30:.2f} GiB",
        flush=True,
    )
    commit = _git_commit()  # now: other work may commit while a long run goes on
    results: list[dict[str, Any]] = []
    try:
        for tp in sorted(set(args.tp)):
            results += bench_tp(geo, tp, tokens, args, log=lambda s: print(s, flush=True))
    except BenchError as e:
        print(f"pd-bench transfer: {e}", file=sys.stderr)
        return 1
    print()
    print(markdown_table(results))
    report = {
        "command": "transfer",
        "commit": commit,
        "device": args.device,
        "memory": memory,
        "geometry": asdict(geo),
        "bytes_per_token": geo.bytes_per_token,
        "tokens": tokens,
        "tp": sorted(set(args.tp)),
        "dst_blocks": args.dst_blocks,
        "reps": args.reps,
        "warmup": args.warmup,
        "poll_us": args.poll_us,
        "copy_threads": args.copy_threads,
        "kv_transport": args.kv_transport,
        "ucx_env": {
            k: v
            for k, v in os.environ.items()
            # expandable_segments: NIXL registers VRAM, UCX may fall back to TCP (nixl#1754)
            if k.startswith("UCX_") or k == "PYTORCH_CUDA_ALLOC_CONF"
        },
        "gb": "1e9 bytes; GB/s = bytes of all ranks / median seconds",
        "results": results,
        "all_data_ok": all(r["data_ok"] is not False for r in results),
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(_clean(report), f, indent=1)
    if args.plot and plot_transfer(report, args.plot):
        print(f"wrote {args.plot}")
    return 0 if report["all_data_ok"] else 1


def _clean(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, float):
        return _json_float(x)
    return x
