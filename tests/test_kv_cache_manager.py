"""The scheduler's KV bookkeeping (``engine/core/kv_cache_manager.py``), driven through the
real scheduler with fake model outputs: what the prefix cache holds, and that a step's
bookkeeping does not grow with the length of the sequences."""

from __future__ import annotations

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput
from engine.sampling_params import SamplingParams
from kvconnector.noop import NoopConnectorScheduler

BLOCK = 4


def _scheduler(num_blocks: int = 256, max_num_seqs: int = 8) -> Scheduler:
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=1024, dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
    )
    return Scheduler(cfg, num_blocks, 1024, NoopConnectorScheduler(cfg, None))  # type: ignore[arg-type]


def _step(s: Scheduler, token: int = 7) -> None:
    so = s.schedule()
    sampled = {q.request_id: token for q in so.seqs if q.samples}
    s.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))


class _CountingCache:
    def __init__(self, pool) -> None:
        self.calls = 0
        self._cache = pool.cache
        pool.cache = self

    def __call__(self, block: int, content_hash: bytes) -> None:
        self.calls += 1
        self._cache(block, content_hash)


def test_registering_full_blocks_costs_each_block_once_not_once_per_step():
    s = _scheduler()
    counter = _CountingCache(s.kv.pool)
    prompt, new = 40, 200
    s.add_request(Request("a", list(range(prompt)), SamplingParams(max_tokens=new)))
    for _ in range(new + 1):
        _step(s)
    full_blocks = (prompt + new - 1) // BLOCK  # the last token is never computed
    # Each full block is registered once; one per step would be ~ full_blocks * steps / 2.
    assert counter.calls <= full_blocks, counter.calls


def test_every_full_computed_block_is_in_the_prefix_cache_and_a_repeat_hits_it():
    s = _scheduler()
    prompt = list(range(10, 47))  # 37 tokens: 9 full blocks
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=9)))
    for _ in range(12):
        _step(s, token=3)
    assert not s.has_work()
    # The request's tokens were prompt + 9 generated; the last one was never computed.
    tokens = prompt + [3] * 9
    again = Request("b", tokens + [1], SamplingParams(max_tokens=1))
    hits = s.kv.get_computed_blocks(again)
    assert len(hits) == (len(tokens) - 1) // BLOCK  # every full computed block


def test_a_preempted_request_registers_its_recomputed_blocks_again():
    # Two requests that outgrow a small pool: one is preempted, freed and recomputed; the
    # blocks it fills after resuming are registered (the per-request count starts over).
    s = _scheduler(num_blocks=24, max_num_seqs=2)
    s.add_request(Request("a", list(range(30)), SamplingParams(max_tokens=30)))
    s.add_request(Request("b", list(range(100, 130)), SamplingParams(max_tokens=30)))
    for _ in range(200):
        if not s.has_work():
            break
        _step(s, token=5)
    assert not s.has_work()
    assert s.num_preemptions_total > 0, "the test should exercise preemption"
    for rid, base in (("a", 0), ("b", 100)):
        tokens = list(range(base, base + 30)) + [5] * 30
        hits = s.kv.get_computed_blocks(Request(rid + "2", tokens + [1], SamplingParams()))
        assert hits, rid


def test_the_prefix_cache_is_keyed_by_sha256_chains_of_the_blocks_tokens():
    """A cache key stands for every token before it, so it must resist a client choosing a
    prompt to collide with another's (Python's 64-bit tuple hash does not: CVE-2025-25183
    in vLLM). The keys are SHA-256 digests chained block to block, the first block's with
    the request's cache_salt, recomputed here from hashlib alone."""
    import hashlib
    import struct

    def le(tokens: list[int]) -> bytes:
        return b"".join(struct.pack("<q", t) for t in tokens)

    s = _scheduler()
    prompt = list(range(300, 313))  # 13 tokens: 3 full blocks
    for salt in (None, "tenant-é"):
        r = Request(f"r{salt}", prompt, SamplingParams(max_tokens=1), cache_salt=salt)
        s.add_request(r)
        _step(s)
        assert not s.has_work()
        if salt is None:
            want = [hashlib.sha256(b"\x00" + le(prompt[:BLOCK])).digest()]
        else:
            raw = salt.encode()
            head = b"\x01" + struct.pack("<I", len(raw)) + raw
            want = [hashlib.sha256(head + le(prompt[:BLOCK])).digest()]
        for i in (1, 2):
            block = prompt[i * BLOCK : (i + 1) * BLOCK]
            want.append(hashlib.sha256(b"\x02" + want[-1] + le(block)).digest())
        assert r.block_hashes[:3] == want
        assert all(s.kv.pool.lookup(k) is not None for k in want)
