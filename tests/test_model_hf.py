"""The paged-KV Llama/Qwen2 implementation matches HF transformers on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import hf_greedy, hf_logits, make_hf_model, random_prompt, save_hf_model
from paged_runner import PagedRunner

from engine.model.config import ModelArchConfig, ModelConfigError, load_arch_config
from engine.model.loader import load_model

pytest.importorskip("transformers")

BLOCK_SIZE = 16
NUM_BLOCKS = 64
VOCAB = 256


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """kind -> (hf_model, checkpoint_dir); the llama checkpoint is saved in several shards."""
    out = {}
    for kind in ("llama", "qwen2", "qwen2_tied"):
        model = make_hf_model(kind)
        shard = "100KB" if kind == "llama" else None
        out[kind] = (model, save_hf_model(model, tmp_path_factory.mktemp(kind), shard))
    return out


def _assert_close(mine: torch.Tensor, ref: torch.Tensor) -> None:
    atol = 1e-4 * max(1.0, float(ref.abs().max()))
    diff = float((mine - ref).abs().max())
    assert diff <= atol, f"max |diff| {diff} > {atol}"


def _runner(model_dir: str) -> PagedRunner:
    net, cfg = load_model(model_dir, dtype="float32")
    return PagedRunner(net, cfg, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)


def test_sharded_checkpoint_was_written(checkpoints: dict) -> None:
    ckpt = Path(checkpoints["llama"][1])
    assert (ckpt / "model.safetensors.index.json").exists()
    assert len(list(ckpt.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen2_tied"])
def test_prefill_logits_match_hf(checkpoints: dict, kind: str) -> None:
    hf, path = checkpoints[kind]
    prompt = random_prompt(70, VOCAB, seed=3)
    mine = _runner(path).prefill(0, prompt)
    assert mine.dtype == torch.float32
    assert mine.shape == (70, VOCAB)
    _assert_close(mine, hf_logits(hf, prompt))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("prompt_len", [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 300])
def test_greedy_decode_matches_hf_generate(checkpoints: dict, kind: str, prompt_len: int) -> None:
    hf, path = checkpoints[kind]
    prompt = random_prompt(prompt_len, VOCAB, seed=prompt_len)
    expected = hf_greedy(hf, prompt, 32)
    tokens, _ = _runner(path).greedy(0, prompt, 32)
    assert tokens == expected


def test_chunked_prefill_matches_full_prefill(checkpoints: dict) -> None:
    hf, path = checkpoints["llama"]
    prompt = random_prompt(45, VOCAB, seed=7)
    chunked = _runner(path).prefill(0, prompt, chunk=7)
    _assert_close(chunked, hf_logits(hf, prompt))
    tokens, _ = _runner(path).greedy(0, prompt, 16, chunk=7)
    assert tokens == hf_greedy(hf, prompt, 16)


def test_batched_step_mixes_prefill_chunk_and_decode(checkpoints: dict) -> None:
    """One forward pass with a decode row of one sequence and a prefill chunk of another."""
    hf, path = checkpoints["qwen2"]
    a, b = random_prompt(20, VOCAB, seed=11), random_prompt(33, VOCAB, seed=12)
    runner = _runner(path)
    runner.prefill(0, a[:-1])
    runner.prefill(1, b[:10])
    out = runner.step({0: a[-1:], 1: b[10:]})
    _assert_close(out[0], hf_logits(hf, a)[-1:])
    _assert_close(out[1], hf_logits(hf, b)[10:])


def test_tiny_model_is_seeded_and_runs() -> None:
    net, cfg = load_model("tiny", seed=0)
    assert cfg == ModelArchConfig.tiny() and cfg.vocab_size >= 258
    again, _ = load_model("tiny", seed=0)
    other, _ = load_model("tiny", seed=1)
    w = net.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(w, again.layers[0].self_attn.qkv_proj.weight)
    assert not torch.equal(w, other.layers[0].self_attn.qkv_proj.weight)
    runner = PagedRunner(net, cfg, num_blocks=8, block_size=BLOCK_SIZE)
    tokens, logits = runner.greedy(0, list(b"hello"), 8)
    assert len(tokens) == 8 and logits.shape == (8, cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_bfloat16_model_runs() -> None:
    net, cfg = load_model("tiny", dtype=torch.bfloat16)
    runner = PagedRunner(net, cfg, num_blocks=8, block_size=BLOCK_SIZE, dtype=torch.bfloat16)
    _, logits = runner.greedy(0, [1, 2, 3], 4)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_load_arch_config_reads_only_config(checkpoints: dict) -> None:
    cfg = load_arch_config(checkpoints["qwen2"][1])
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.qkv_bias
    assert load_arch_config(checkpoints["qwen2_tied"][1]).tie_word_embeddings


def _hf_dict(**overrides: object) -> dict:
    d = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "eos_token_id": [128001, 128009],
        "bos_token_id": 128000,
    }
    d.update(overrides)
    return d


def test_config_transformers4_layout_and_eos_list() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = ModelArchConfig.from_hf_dict(_hf_dict(rope_scaling=scaling))
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == scaling
    assert cfg.head_dim == 16 and cfg.eos_token_id == 128001
    assert cfg.eos_token_ids == (128001, 128009)
    linear = ModelArchConfig.from_hf_dict(_hf_dict(rope_scaling={"type": "linear", "factor": 2}))
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 2}


def test_config_refuses_unsupported() -> None:
    with pytest.raises(ModelConfigError, match="yarn"):
        ModelArchConfig.from_hf_dict(_hf_dict(rope_scaling={"rope_type": "yarn", "factor": 4}))
    with pytest.raises(ModelConfigError, match="not supported"):
        ModelArchConfig.from_hf_dict(_hf_dict(architectures=["GPT2LMHeadModel"]))
    mistral = _hf_dict(architectures=["MistralForCausalLM"], sliding_window=4096)
    with pytest.raises(ModelConfigError, match="sliding_window"):
        ModelArchConfig.from_hf_dict(mistral)
    assert ModelArchConfig.from_hf_dict(mistral, max_model_len=4096).architecture
    assert ModelArchConfig.from_hf_dict(dict(mistral, sliding_window=None)).architecture


def test_validate_tp() -> None:
    cfg = ModelArchConfig.tiny()
    cfg.validate_tp(2)
    assert cfg.num_kv_heads_per_rank(2) == 1
    cfg.validate_tp(4)  # more ranks than KV heads: replicated (tests/test_kv_head_range.py)
    assert cfg.num_kv_heads_per_rank(4) == 1
    with pytest.raises(ModelConfigError, match="num_attention_heads"):
        cfg.validate_tp(8)
    with pytest.raises(ModelConfigError, match="num_attention_heads"):
        cfg.validate_tp(3)
