#!/usr/bin/env python
"""How many NIXL descriptors a KV push takes after block-pool churn, and what one
``BlockPool.allocate`` costs.

A push moves runs of consecutive block ids on *both* sides as one descriptor each
(``kvconnector/nixl/block_runs.py``); on an H200 a descriptor costs ~15-25 us whatever its
size (docs/performance.md). This drives a prefill node's and a decode node's real
``KVCacheManager`` (block pool, prefix cache) through the calls their schedulers make, no
model: P prefills in chunks of ``--budget`` tokens, holds the blocks until the push, frees
them; D reserves a whole remote prompt at arrival (one ``allocate_slots``), lands it,
decodes (one block at a time as the sequence grows) and frees at a random length, so
requests end in an order other than their arrival. Prompts: an optional shared prefix
(one of a few) and a unique suffix of a random length. Pools smaller than the work, so
they cycle many times. Per transfer: ``len(block_runs(p_blocks, d_blocks))`` against the
blocks moved, and each side's own runs.

    python scripts/bench_block_runs.py                 # both caching modes, default load
    python scripts/bench_block_runs.py --timeit        # + allocate(n) cost, n = 1 .. 512
"""

from __future__ import annotations

import argparse
import random
import time
from collections import deque
from dataclasses import dataclass, field

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from kvconnector.nixl.block_runs import block_runs


@dataclass
class Churn:
    """One run's totals over its transfers (those past ``warmup``)."""

    transfers: int = 0
    blocks: int = 0
    descriptors: int = 0
    p_runs: int = 0
    d_runs: int = 0
    per_transfer: list[tuple[int, int]] = field(default_factory=list, repr=False)  # (blocks, descs)

    def add(self, other: Churn) -> None:
        """Add ``other``'s totals (not its per-transfer list) to these."""
        for k in ("transfers", "blocks", "descriptors", "p_runs", "d_runs"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    @property
    def ratio(self) -> float:
        """Descriptors per block moved: 1.0 is one descriptor per block."""
        return self.descriptors / max(1, self.blocks)

    def row(self, name: str) -> str:
        return (
            f"{name:<24} transfers {self.transfers:5d}  blocks {self.blocks:7d}  "
            f"descs {self.descriptors:6d} ({self.ratio:.3f}/block, "
            f"{self.blocks / max(1, self.descriptors):.1f} blocks/desc)  "
            f"P runs {self.p_runs / max(1, self.blocks):.3f}/block  "
            f"D runs {self.d_runs / max(1, self.blocks):.3f}/block"
        )


def simulate(
    *,
    caching: bool,
    seed: int = 0,
    requests: int = 2000,
    p_blocks: int = 4096,
    d_blocks: int = 4096,
    block_size: int = 16,
    budget: int = 2048,
    arrivals_per_step: float = 0.35,
    warmup: int = 1000,
    prompt_tokens: tuple[int, int] = (32, 3000),
    prefix_tokens: tuple[int, ...] = (256, 1024, 2048),
    output_tokens: tuple[int, int] = (8, 600),
) -> Churn:
    """P's and D's pools through ``requests`` P/D requests; totals past the first
    ``warmup`` (a fresh pool hands out ascending ids: the pools take ~1000 requests of
    the default sizes to reach a steady state)."""
    rng = random.Random(seed)
    p = KVCacheManager(p_blocks, block_size, enable_caching=caching)
    d = KVCacheManager(d_blocks, block_size, enable_caching=caching)
    prefixes = [[1000 + 10 * i + j for j in range(n)] for i, n in enumerate(prefix_tokens)]
    out = Churn()

    def new_request(i: int) -> tuple[Request, Request, int]:
        head = rng.choice(prefixes) if rng.random() < 0.5 else []
        tail = [rng.randrange(1, 1 << 30) for _ in range(rng.randint(*prompt_tokens))]
        prompt = head + tail
        params = SamplingParams(max_tokens=1)
        # P's leg and D's leg: the same prompt, each node its own Request
        out_len = rng.randint(*output_tokens)
        return Request(f"p{i}", prompt, params), Request(f"d{i}", prompt, params), out_len

    queued: deque[tuple[Request, Request, int]] = deque()  # arrived, D not reserved yet
    prefilling: list[tuple[Request, Request, int, list[int]]] = []  # P computing; D's dst
    decoding: dict[str, tuple[Request, int]] = {}
    made = 0
    step = 0
    while made < requests or queued or prefilling or decoding:
        step += 1
        # arrivals
        credit = arrivals_per_step
        while made < requests and rng.random() < credit:
            queued.append(new_request(made))
            made += 1
            credit -= 1
        # D reserves the whole remote prompt at once, FIFO, when it fits
        while queued:
            preq, dreq, out_len = queued[0]
            computed = d.get_computed_blocks(dreq)
            dreq.num_computed_tokens = len(computed) * block_size
            ext = dreq.num_prompt_tokens - dreq.num_computed_tokens
            blocks = d.allocate_slots(dreq, ext, computed)
            if blocks is None:
                dreq.num_computed_tokens = 0
                break
            queued.popleft()
            skip = dreq.num_computed_tokens // block_size
            prefilling.append((preq, dreq, out_len, list(blocks[skip:])))
        # P: chunked prefill in arrival order, ``budget`` tokens per step
        left = budget
        done = []
        for entry in prefilling:
            preq = entry[0]
            if left <= 0:
                break
            first = not p.has_blocks(preq.request_id)
            computed = p.get_computed_blocks(preq) if first else []
            if first:
                preq.num_computed_tokens = len(computed) * block_size
            n = min(preq.num_prompt_tokens - preq.num_computed_tokens, left)
            if p.allocate_slots(preq, n, computed) is None:
                if first:
                    preq.num_computed_tokens = 0
                break
            preq.num_computed_tokens += n
            p.cache_computed_blocks(preq)
            left -= n
            if preq.num_computed_tokens == preq.num_prompt_tokens:
                done.append(entry)
        # P's prefills that finished: the push, then P frees; D lands and decodes
        for entry in done:
            prefilling.remove(entry)
            preq, dreq, out_len, dst = entry
            skip = len(d.block_ids(dreq.request_id)) - len(dst)
            src = p.block_ids(preq.request_id)[skip : skip + len(dst)]
            assert len(src) == len(dst)
            if int(preq.request_id[1:]) >= warmup:
                descs = len(block_runs(src, dst))
                out.transfers += 1
                out.blocks += len(dst)
                out.descriptors += descs
                out.p_runs += len(block_runs(src, src))
                out.d_runs += len(block_runs(dst, dst))
                out.per_transfer.append((len(dst), descs))
            p.free(preq.request_id)
            dreq.num_computed_tokens = dreq.num_prompt_tokens
            d.cache_computed_blocks(dreq)
            dreq.append_token(7)
            decoding[dreq.request_id] = (dreq, out_len)
        # D: one decode step for every request it runs
        for rid, (dreq, out_len) in list(decoding.items()):
            if dreq.num_output_tokens >= out_len or rng.random() < 0.002:  # ends (or aborts)
                d.free(rid)
                del decoding[rid]
                continue
            if d.allocate_slots(dreq, 1) is None:
                continue  # D is full: it waits (the real one would preempt)
            dreq.num_computed_tokens += 1
            d.cache_computed_blocks(dreq)
            dreq.append_token(rng.randrange(1, 1 << 30))
    return out


def time_allocate(
    num_blocks: int = 100_000, sizes=(1, 4, 16, 64, 256, 512), repeat: int = 5
) -> dict[int, float]:
    """Microseconds per ``allocate(n)`` from a churned ``num_blocks`` pool (every block
    freed once, in a shuffled order, 64 at a time; half of them cached): the best of
    ``repeat`` rounds of ~20k blocks each, which are freed again after the round."""
    rng = random.Random(1)
    pool = BlockPool(num_blocks, enable_caching=True)
    ids = pool.allocate(num_blocks)
    rng.shuffle(ids)
    for i, b in enumerate(ids[: num_blocks // 2]):
        pool.cache(b, i.to_bytes(8, "little"))  # type: ignore[arg-type]
    for k in range(0, num_blocks, 64):
        pool.free(ids[k : k + 64])
    result = {}
    for n in sizes:
        reps = max(20, 20_000 // n)
        best = float("inf")
        for _ in range(repeat):
            taken = []
            t0 = time.perf_counter()
            for _ in range(reps):
                taken.append(pool.allocate(n))
            best = min(best, (time.perf_counter() - t0) / reps)
            for blocks in taken:
                pool.free(blocks)
        result[n] = best * 1e6
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=1000, help="requests not counted")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[0.1, 0.35],
        help="new requests per step: 0.1 leaves D some free room, 0.35 keeps it full",
    )
    ap.add_argument("--timeit", action="store_true", help="also time allocate(n)")
    args = ap.parse_args()
    for rate in args.rates:
        for caching in (False, True):
            total = Churn()
            for seed in range(args.seeds):
                r = simulate(
                    caching=caching,
                    seed=seed,
                    requests=args.requests,
                    warmup=args.warmup,
                    arrivals_per_step=rate,
                )
                total.add(r)
            print(total.row(f"rate {rate:g}, caching {'on' if caching else 'off'}"))
    if args.timeit:
        for n, us in time_allocate().items():
            print(f"allocate({n:3d}) of a churned 100k-block pool: {us:8.1f} us")


if __name__ == "__main__":
    main()
