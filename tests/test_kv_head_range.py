"""Which KV heads a TP rank holds (``ModelArchConfig.kv_head_range``): split when the TP size
divides the KV heads, one replicated head per rank when it is a multiple of them (as vLLM's
QKVParallelLinear); the KV cache, the attention layer and the k/v rows each rank loads follow
it. In-process: no rank runs a forward here (``test_model_tp.py`` runs TP 4 end to end)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hf_models import make_hf_model, save_hf_model

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from engine.kv_cache_layout import KVCacheSpec
from engine.model.config import ModelArchConfig, ModelConfigError
from engine.model.loader import load_model, tiny_state_dict


def _arch(heads: int, kv_heads: int) -> ModelArchConfig:
    return dataclasses.replace(
        ModelArchConfig.tiny(), num_attention_heads=heads, num_key_value_heads=kv_heads
    )


def _ranges(cfg: ModelArchConfig, tp: int) -> list[tuple[int, int]]:
    return [cfg.kv_head_range(rank, tp) for rank in range(tp)]


def test_tp_below_kv_heads_splits_them() -> None:
    cfg = _arch(heads=16, kv_heads=8)
    assert _ranges(cfg, 1) == [(0, 8)]
    assert _ranges(cfg, 2) == [(0, 4), (4, 4)]
    assert _ranges(cfg, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert cfg.num_kv_heads_per_rank(4) == 2


def test_tp_equal_to_kv_heads_one_head_each() -> None:
    cfg = ModelArchConfig.tiny()  # 4 query heads, 2 KV heads
    assert _ranges(cfg, 2) == [(0, 1), (1, 1)]
    assert cfg.num_kv_heads_per_rank(2) == 1


def test_tp_above_kv_heads_replicates_them() -> None:
    cfg = ModelArchConfig.tiny()
    assert _ranges(cfg, 4) == [(0, 1), (0, 1), (1, 1), (1, 1)]  # rank r: head r // 2
    assert cfg.num_kv_heads_per_rank(4) == 1
    assert _ranges(_arch(heads=8, kv_heads=2), 8) == [(r // 4, 1) for r in range(8)]
    assert _ranges(_arch(heads=4, kv_heads=1), 4) == [(0, 1)] * 4  # MQA: every rank


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (16, 8), (8, 2), (4, 1), (4, 4)])
def test_every_rank_holds_the_kv_heads_of_its_query_heads(heads: int, kv_heads: int) -> None:
    cfg = _arch(heads, kv_heads)
    group = heads // kv_heads
    for tp in cfg.valid_tp_sizes():
        covered = set()
        for rank in range(tp):
            first, count = cfg.kv_head_range(rank, tp)
            q_local = cfg.num_heads_per_rank(tp)
            q_heads = range(rank * q_local, (rank + 1) * q_local)
            assert {q // group for q in q_heads} == set(range(first, first + count)), (tp, rank)
            covered.update(range(first, first + count))
        assert covered == set(range(kv_heads)), tp


def test_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="rank 4 out of range"):
        ModelArchConfig.tiny().kv_head_range(4, 4)


def test_refusals_name_the_problem_and_the_valid_sizes() -> None:
    tiny = ModelArchConfig.tiny()
    assert tiny.valid_tp_sizes() == [1, 2, 4]
    # tp a multiple of the KV heads, but the query heads do not split
    with pytest.raises(ModelConfigError, match="num_attention_heads=4 is not divisible by 8"):
        tiny.kv_head_range(0, 8)
    with pytest.raises(ModelConfigError, match=r"use --tp 1, 2 or 4 for this model"):
        tiny.validate_tp(8)
    # neither a divisor nor a multiple of the KV heads (query heads do split)
    cfg = _arch(heads=12, kv_heads=4)
    with pytest.raises(ModelConfigError) as err:
        cfg.validate_tp(6)
    message = str(err.value)
    assert "num_key_value_heads=4 neither is divisible by 6 nor divides it" in message
    assert "num_attention_heads" not in message
    assert "replicated one per rank when --tp is a multiple of 4" in message
    assert message.endswith("use --tp 1, 2 or 4 for this model")
    with pytest.raises(ModelConfigError, match="must be >= 1"):
        tiny.validate_tp(0)


def test_kv_cache_spec_holds_one_head_per_rank_when_replicated() -> None:
    def spec(tp: int) -> KVCacheSpec:
        config = EngineConfig(
            model=ModelConfig(model="tiny", dtype="float32"),
            cache=CacheConfig(block_size=16),
            parallel=ParallelConfig(tp=tp),
        )
        return KVCacheSpec.for_model(ModelArchConfig.tiny(), config)

    assert [spec(tp).num_kv_heads for tp in (1, 2, 4)] == [2, 1, 1]
    assert spec(4).block_bytes == spec(2).block_bytes  # replicated, not split further


def _qkv_rows(net: torch.nn.Module) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Layer 0's local (q, k, v) weight rows and (q, k, v) bias rows (empty: no bias)."""
    qkv = net.layers[0].self_attn.qkv_proj
    biases = () if qkv.bias is None else tuple(qkv.bias.split(qkv.local_sizes))
    return tuple(qkv.weight.split(qkv.local_sizes)), biases


def _rows(t: torch.Tensor, head: int, d: int) -> torch.Tensor:
    return t[head * d : (head + 1) * d]


def test_tiny_rank_loads_the_rows_of_its_replicated_kv_head() -> None:
    full = tiny_state_dict(ModelArchConfig.tiny(), seed=0)
    for rank in range(4):
        net, cfg = load_model("tiny", tp_rank=rank, tp_size=4)
        d = cfg.head_dim
        attn = net.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        (q, k, v), _ = _qkv_rows(net)
        p = "model.layers.0.self_attn."
        assert torch.equal(q, _rows(full[p + "q_proj.weight"], rank, d))
        assert torch.equal(k, _rows(full[p + "k_proj.weight"], rank // 2, d))
        assert torch.equal(v, _rows(full[p + "v_proj.weight"], rank // 2, d))


def test_checkpoint_rank_loads_the_weight_and_bias_rows_of_its_kv_head(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    hf = make_hf_model("qwen2")  # 4 query heads, 2 KV heads, q/k/v biases
    ckpt = save_hf_model(hf, tmp_path / "qwen2", max_shard_size="100KB")
    full = {k: v.detach() for k, v in hf.state_dict().items()}
    p = "model.layers.0.self_attn."
    for rank in range(4):
        net, cfg = load_model(ckpt, tp_rank=rank, tp_size=4)
        d = cfg.head_dim
        (q, k, v), (qb, kb, vb) = _qkv_rows(net)
        head = cfg.kv_head_range(rank, 4)[0]
        assert head == rank // 2
        assert torch.equal(q, _rows(full[p + "q_proj.weight"], rank, d))
        assert torch.equal(k, _rows(full[p + "k_proj.weight"], head, d))
        assert torch.equal(v, _rows(full[p + "v_proj.weight"], head, d))
        assert torch.equal(qb, _rows(full[p + "q_proj.bias"], rank, d))
        assert torch.equal(kb, _rows(full[p + "k_proj.bias"], head, d))
        assert torch.equal(vb, _rows(full[p + "v_proj.bias"], head, d))
