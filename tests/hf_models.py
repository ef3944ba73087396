"""Helpers for the model tests: tiny random HF checkpoints written with transformers."""

from __future__ import annotations

from pathlib import Path

import torch

LM_HEAD_SCALE = 20.0  # widens logit gaps so greedy choices are not near-ties


def make_hf_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random fp32 HF model: 'llama' (llama3 rope scaling), 'qwen2' (qkv bias) or
    'qwen2_tied' (qkv bias, tied embeddings; its greedy output tends to repeat one token, so
    use it for logits checks). Biases and norm weights are randomized so their loading is
    tested."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(
            **common,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind in ("qwen2", "qwen2_tied"):
        config = transformers.Qwen2Config(
            **common, rope_theta=10000.0, tie_word_embeddings=kind == "qwen2_tied"
        )
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(kind)
    model = model.float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            elif "norm" in name:
                param.copy_(1.0 + torch.randn(param.shape, generator=gen) * 0.1)
        if kind == "qwen2_tied":  # tied: scale the final norm instead, same effect on logits
            model.model.norm.weight.mul_(LM_HEAD_SCALE)
        else:
            model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_hf_model(model: torch.nn.Module, path: Path, max_shard_size: str | None = None) -> str:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return str(path)


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()  # [T, vocab]


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()
