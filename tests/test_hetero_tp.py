"""Heterogeneous TP (issue 11): P and D with different TP sizes. Each P rank writes into
each D rank exactly the KV heads that D rank owns, as head slices of every (block, layer,
kv); D ranks count one notification per P rank writing to them; completion still follows
the all-ranks rule."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvconnector.nixl.tp_map import check_tp, head_range, senders, writes_of

sys.path.insert(0, str(Path(__file__).parent))
from hf_models import random_prompt  # noqa: E402
from pd_utils import disagg_generate, nixl_config  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0)
SIZES = [(h, p, d) for h in (1, 2, 4, 8) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8)]


def _valid(h: int, *tps: int) -> bool:
    return all(h % tp == 0 or tp % h == 0 for tp in tps)


@pytest.mark.parametrize(("heads", "tp_p", "tp_d"), [s for s in SIZES if _valid(*s)])
def test_every_d_rank_gets_each_of_its_heads_exactly_once(heads, tp_p, tp_d):
    for d in range(tp_d):
        d0, dn = head_range(d, tp_d, heads)
        got: list[int] = []
        for p in range(tp_p):
            p0, pn = head_range(p, tp_p, heads)
            for w in writes_of(p, tp_p, tp_d, heads):
                if w.d_rank != d:
                    continue
                assert p0 + w.p_offset == d0 + w.d_offset  # the same global heads
                assert w.p_offset + w.count <= pn and w.d_offset + w.count <= dn
                assert w.whole_blocks == (w.count == pn == dn)
                got.extend(range(d0 + w.d_offset, d0 + w.d_offset + w.count))
        assert sorted(got) == list(range(d0, d0 + dn))
        writers = sum(
            any(w.d_rank == d for w in writes_of(p, tp_p, tp_d, heads)) for p in range(tp_p)
        )
        assert senders(d, tp_p, tp_d, heads) == writers


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_map_agrees_with_how_the_model_shards_its_kv_heads(tp):
    """One rule on both sides: the heads a rank's KV cache holds (the model's sharding)
    are the heads the connector says it owns."""
    from engine.model.config import ModelArchConfig

    arch = ModelArchConfig.tiny()
    for rank in range(tp):
        assert head_range(rank, tp, arch.num_key_value_heads) == arch.kv_head_range(rank, tp)


def test_replicated_heads_spread_d_ranks_over_p_replicas():
    # 2 KV heads, P with TP 4 (each head on 2 ranks) -> D with TP 2: both replicas work.
    assert [w.d_rank for w in writes_of(0, 4, 2, 2)] == [0]
    assert [w.d_rank for w in writes_of(1, 4, 2, 2)] == []  # head 0's other replica
    assert [w.d_rank for w in writes_of(2, 4, 2, 2)] == []
    assert [w.d_rank for w in writes_of(3, 4, 2, 2)] == [1]
    # -> D with TP 4 (the same layout): rank r writes rank r, whole blocks.
    same = [writes_of(p, 4, 4, 2) for p in range(4)]
    assert [[(w.d_rank, w.whole_blocks) for w in ws] for ws in same] == [
        [(r, True)] for r in range(4)
    ]


@pytest.mark.parametrize(("tp", "heads"), [(3, 2), (2, 3), (0, 2)])
def test_tp_sizes_that_do_not_map_onto_the_heads_are_refused(tp, heads):
    with pytest.raises(ValueError):
        check_tp(tp, heads)


def test_a_head_slice_write_moves_exactly_those_heads():
    """Real NIXL, two agents: P rank with 1 head writes it into head 1 of D's 2 heads;
    D's head 0 and every other block are untouched."""
    from kvconnector.nixl.transport import NixlTransport

    layers, bs, dim = 3, 4, 8
    p_kv = torch.randn(6, layers, 2, 1, bs, dim)  # [block, layer, kv, head, token, dim]
    d_kv = torch.zeros(6, layers, 2, 2, bs, dim)
    sentinel = d_kv.clone()
    p = NixlTransport(
        f"P-{uuid.uuid4().hex[:6]}", p_kv, p_kv[0].numel() * 4, num_layers=layers, num_heads=1
    )
    d = NixlTransport(
        f"D-{uuid.uuid4().hex[:6]}", d_kv, d_kv[0].numel() * 4, num_layers=layers, num_heads=2
    )
    try:
        p.add_peer("d", d.metadata(), heads=(0, 1, 1))
        handle = p.write_blocks("d", [1, 2], [4, 0], b"n")
        deadline = time.monotonic() + 30
        while p.poll(handle) == "pending" and time.monotonic() < deadline:
            time.sleep(0.001)
        assert p.poll(handle) == "done"
        assert handle.num_descriptors == 2 * layers * 2  # one per (block, layer, kv)
        assert handle.num_bytes == 2 * layers * 2 * bs * dim * 4
        assert torch.equal(d_kv[4, :, :, 1], p_kv[1, :, :, 0])
        assert torch.equal(d_kv[0, :, :, 1], p_kv[2, :, :, 0])
        sentinel[4, :, :, 1] = d_kv[4, :, :, 1]
        sentinel[0, :, :, 1] = d_kv[0, :, :, 1]
        assert torch.equal(d_kv, sentinel)  # nothing else was written
        with pytest.raises(ValueError, match="out of"):
            p.add_peer("bad", d.metadata(), heads=(0, 2, 1))  # D has heads 0..1
    finally:
        p.close()
        d.close()


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random Qwen2 checkpoint (qkv bias) with 2 KV heads: TP 4 replicates each head."""
    from hf_models import make_hf_model, save_hf_model

    model = make_hf_model("qwen2", seed=3)
    assert model.config.num_key_value_heads == 2
    return save_hf_model(model, tmp_path_factory.mktemp("qwen2") / "qwen2")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "qwen2"])
@pytest.mark.parametrize(
    ("tp_p", "tp_d", "kv_checksum"),
    [(1, 2, "off"), (2, 1, "full"), (2, 4, "full")],
    ids=["P1-D2", "P2-D1", "P2-D4-replicated"],
)
def test_prefill_and_decode_with_different_tp_match_colocated(
    tp_p, tp_d, kv_checksum, model, request
):
    """Real engines (worker processes, NIXL over UCX): D decodes from KV written by P
    ranks of another TP size and answers what a colocated node answers; D computes no
    prompt token; with checksums on, the head slices verify on every D rank. On ``tiny``
    (Llama) and on a random Qwen2 checkpoint, both with 2 KV heads."""
    path = "tiny" if model == "tiny" else request.getfixturevalue("qwen2_dir")
    base = EngineConfig(model=ModelConfig(model=path), cache=CacheConfig(num_blocks=96))

    def node(role: str, tp: int) -> EngineCore:
        cfg = base.replace(parallel=ParallelConfig(tp=tp))
        return EngineCore(nixl_config(cfg, role, kv_checksum=kv_checksum))

    p, d = node("producer", tp_p), node("consumer", tp_d)
    try:
        prompts = [random_prompt(n, 256, seed=n) for n in (9, 40, 77)]
        res = disagg_generate(p, d, prompts, GREEDY, timeout=180)
        with LLM(base) as llm:
            assert res["tokens"] == llm.generate_token_ids(prompts, GREEDY)
        assert all(f.error is None for f in res["final"])
        ds, ps = d.stats(), p.stats()
        assert ds["prompt_tokens_total"] == 0  # decoded from the pushed KV
        assert ds["kv_checksum_failures_total"] == 0
        # Every D rank got every head once: each P rank wrote its heads of every block.
        blocks = sum(-(-len(x) // base.cache.block_size) for x in prompts)
        assert ps["kv_blocks_sent_total"] == blocks * max(tp_p, tp_d)
        for eng in (p, d):
            s = eng.stats()
            assert s["kv_blocks_free"] == s["kv_blocks_total"]
            assert eng.executor.aggregator.pending_ids == set()
    finally:
        p.shutdown()
        d.shutdown()
