"""The block pool's allocation order (``engine/core/block_pool.py``): after churn an
allocation's blocks ascend, so a KV push moves them as few NIXL descriptors
(``kvconnector/nixl/block_runs.py``: runs of consecutive ids on both sides), while the
prefix cache still loses its content in LRU order and no sooner."""

from __future__ import annotations

import importlib.util
import random
import sys

from harness import REPO_ROOT

from engine.core.block_hash import block_key
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from kvconnector.nixl.block_runs import block_runs


def _runs(blocks: list[int]) -> int:
    return len(block_runs(blocks, blocks))


def _key(block: int) -> bytes:
    return block_key(None, [block])


def _churned(num_blocks: int, caching: bool, seed: int) -> tuple[BlockPool, list[list[int]]]:
    """A pool whose blocks went to requests of varied sizes, then came back in a shuffled
    order (each request's blocks freed together, as a finished request's are). Returns
    the pool and the freed requests' blocks in the order they were freed."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks, enable_caching=caching)
    held = []
    while pool.num_free:
        held.append(pool.allocate(min(rng.randint(1, 24), pool.num_free)))
    rng.shuffle(held)
    for blocks in held:
        pool.free(blocks)
    return pool, held


def test_after_churn_the_blocks_of_one_allocation_ascend() -> None:
    for caching in (False, True):
        pool, _ = _churned(256, caching, seed=1)
        for n in (2, 5, 17, 40, 64):
            blocks = pool.allocate(n)
            assert blocks == sorted(blocks), (caching, n, blocks)


def test_an_allocation_after_churn_is_as_few_runs_as_its_ids_allow() -> None:
    # A request freed whole goes back as one run: the next request of that size takes it
    # as one run (not one descriptor per block, as the reversed free list gave).
    pool, freed = _churned(256, caching=True, seed=2)
    first = freed[0]
    assert _runs(sorted(first)) == 1
    assert _runs(pool.allocate(len(first))) == 1


def test_cached_blocks_are_evicted_in_lru_order_and_the_allocation_takes_that_set() -> None:
    # Every free block holds cached content: an allocation takes exactly the n least
    # recently freed blocks (a request's tail before its head), as the LRU list did --
    # only their order inside the allocation may differ.
    pool, held = _churned(128, caching=True, seed=3)
    for blocks in held:
        pool.touch(blocks[0])  # take them again to cache them, then free them in order
        for b in blocks[1:]:
            pool.touch(b)
        for b in blocks:
            pool.cache(b, _key(b))
    rng = random.Random(3)
    rng.shuffle(held)
    lru: list[int] = []
    for blocks in held:
        pool.free(blocks)
        lru.extend(reversed(blocks))
    taken = 0
    for n in (3, 10, 1, 20, 5, 40):
        got = pool.allocate(n)
        assert sorted(got) == sorted(lru[taken : taken + n]), n
        taken += n
        assert all(pool.lookup(_key(b)) is None for b in lru[:taken])
        assert all(pool.lookup(_key(b)) == b for b in lru[taken:])


def test_blocks_without_cached_content_may_stand_in_but_cached_ones_go_in_lru_order() -> None:
    # Half the blocks hold cached content. Whatever blocks an allocation takes, the cached
    # content it evicts is the oldest in LRU order, and no more of it than the n least
    # recently freed blocks hold (what the LRU list alone would have evicted).
    rng = random.Random(4)
    pool = BlockPool(200, enable_caching=True)
    lru = list(range(200))  # the test's own model of the free list, oldest first
    live: list[list[int]] = []
    for _ in range(300):
        if live and (pool.num_free < 30 or rng.random() < 0.45):
            blocks = live.pop(rng.randrange(len(live)))
            pool.free(blocks)
            lru.extend(reversed(blocks))
            continue
        n = rng.randint(1, min(30, pool.num_free))
        after = rng.choice(live)[-1] if live and rng.random() < 0.5 else None
        cached_lru = [b for b in lru if pool.lookup(_key(b)) == b]
        most = sum(1 for b in lru[:n] if pool.lookup(_key(b)) == b)
        blocks = pool.allocate(n, after=after)
        assert len(set(blocks)) == n and all(b in lru for b in blocks)
        evicted = [b for b in cached_lru if pool.lookup(_key(b)) is None]
        assert evicted == cached_lru[: len(evicted)]  # the oldest cached ones
        assert len(evicted) <= most
        assert set(evicted) <= set(blocks)
        lru = [b for b in lru if b not in set(blocks)]
        for b in blocks:
            if rng.random() < 0.5:
                pool.cache(b, _key(b))
        live.append(blocks)


def test_a_request_growing_over_several_calls_continues_its_run_when_the_next_block_is_free():
    # Chunked prefill and decode growth allocate a request's blocks a few at a time; when
    # the block after its last one is free and holds no cached content, it gets that one.
    kv = KVCacheManager(64, 4, enable_caching=False)
    a = Request("a", list(range(8)), SamplingParams(max_tokens=16))
    b = Request("b", list(range(8)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(a, 8) == [0, 1]
    assert kv.allocate_slots(b, 8) == [2, 3]
    kv.free("b")  # its blocks go to the tail of the free list
    a.num_computed_tokens = 8
    blocks = kv.allocate_slots(a, 8)
    assert blocks == [0, 1, 2, 3], blocks
    assert _runs(blocks) == 1


def _bench():
    path = REPO_ROOT / "scripts" / "bench_block_runs.py"
    spec = importlib.util.spec_from_file_location("bench_block_runs", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_block_runs", mod)
    spec.loader.exec_module(mod)
    return mod


def test_after_p_and_d_churn_a_push_takes_fewer_descriptors_than_blocks() -> None:
    # P prefills in chunks and frees after the push; D reserves a whole remote prompt at
    # once, decodes one block at a time and frees in another order: the real
    # KVCacheManager on both, pools a quarter of the script's default, counted once they
    # are churned. The LRU list alone gave ~1.0 descriptor per block moved.
    bench = _bench()
    small = dict(
        p_blocks=1024,
        d_blocks=1024,
        budget=512,
        prompt_tokens=(8, 750),
        prefix_tokens=(64, 256, 512),
        output_tokens=(2, 150),
        requests=1200,
        warmup=600,
        arrivals_per_step=0.1,  # D has some room free
    )
    off = bench.simulate(caching=False, **small)
    assert off.transfers > 500
    # nothing cached: free blocks next to an allocation's extend its runs
    assert off.ratio < 0.2, off.row("caching off")
    on = bench.simulate(caching=True, **small)
    # cached blocks go in LRU order: only the order inside an allocation, and the few
    # blocks holding nothing cached, are free to choose
    assert on.ratio < 0.92, on.row("caching on")
