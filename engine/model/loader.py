"""Build a model for one TP rank: random 'tiny' weights or an HF safetensors checkpoint.

Each rank reads only its own slice of every sharded tensor (``safe_open(...).get_slice``).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack

import torch

from engine.config import TINY_MODEL
from engine.kv_cache_layout import torch_dtype
from engine.model.config import ModelArchConfig, checkpoint_files, load_arch_config
from engine.model.llama import LlamaForCausalLM
from engine.model.parallel import ShardReader

logger = logging.getLogger(__name__)

__all__ = ["TINY_MODEL", "load_arch_config", "load_model", "tiny_state_dict"]

TINY_INIT_STD = 0.02


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return torch_dtype(dtype)
    except ValueError:
        raise ValueError(f"unsupported dtype {dtype!r}") from None


def _narrow_reader(full: torch.Tensor) -> ShardReader:
    def read(dim: int | None, start: int, end: int) -> torch.Tensor:
        return full if dim is None else full.narrow(dim, start, end - start)

    return read


def tiny_state_dict(cfg: ModelArchConfig, seed: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) HF-named float32 weights drawn from ``seed`` in a fixed order."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * TINY_INIT_STD

    h, d = cfg.hidden_size, cfg.head_dim
    q_size, kv_size = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = normal(q_size, h)
        sd[p + "self_attn.k_proj.weight"] = normal(kv_size, h)
        sd[p + "self_attn.v_proj.weight"] = normal(kv_size, h)
        if cfg.qkv_bias:
            sd[p + "self_attn.q_proj.bias"] = normal(q_size)
            sd[p + "self_attn.k_proj.bias"] = normal(kv_size)
            sd[p + "self_attn.v_proj.bias"] = normal(kv_size)
        sd[p + "self_attn.o_proj.weight"] = normal(h, q_size)
        sd[p + "mlp.gate_proj.weight"] = normal(cfg.intermediate_size, h)
        sd[p + "mlp.up_proj.weight"] = normal(cfg.intermediate_size, h)
        sd[p + "mlp.down_proj.weight"] = normal(h, cfg.intermediate_size)
        sd[p + "input_layernorm.weight"] = torch.ones(h)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h)
    sd["model.norm.weight"] = torch.ones(h)
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = normal(cfg.vocab_size, h)
    return sd


def _load_checkpoint(model: LlamaForCausalLM, model_dir: str) -> None:
    from safetensors import safe_open

    with ExitStack() as stack:
        handles = {}
        for path in checkpoint_files(model_dir):
            handle = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            for key in handle.keys():  # noqa: SIM118 -- safe_open is not a dict
                handles[key] = handle

        def reader_for(name: str) -> ShardReader:
            tensor_slice = handles[name].get_slice(name)

            def read(dim: int | None, start: int, end: int) -> torch.Tensor:
                if dim is None:
                    return tensor_slice[:]
                shape = tensor_slice.get_shape()
                if end > shape[dim]:
                    raise ValueError(
                        f"{name}: needs rows [{start}, {end}) of dim {dim}, tensor has {shape[dim]}"
                    )
                index = [slice(None)] * len(shape)
                index[dim] = slice(start, end)
                return tensor_slice[tuple(index)]

            return read

        model.load_weights(sorted(handles), reader_for)


def load_model(
    model: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    max_model_len: int | None = None,
    attention_backend: str = "auto",
) -> tuple[LlamaForCausalLM, ModelArchConfig]:
    """Build rank ``tp_rank``'s shard of ``model`` ('tiny' or a checkpoint dir), in eval mode."""
    torch_dtype = _parse_dtype(dtype)
    device_str = str(device)
    cfg = load_arch_config(model, max_model_len=max_model_len)
    cfg.validate_tp(tp_size)
    net = LlamaForCausalLM(cfg, tp_rank, tp_size, torch_dtype, device_str, attention_backend)
    if model == TINY_MODEL:
        sd = tiny_state_dict(cfg, seed)
        net.load_weights(list(sd), lambda name: _narrow_reader(sd[name]))
    else:
        _load_checkpoint(net, model)
    net.eval()
    logger.info(
        "loaded %s (%s) rank %s/%s: %s params on this rank, dtype %s, device %s",
        model,
        cfg.architecture,
        tp_rank,
        tp_size,
        sum(p.numel() for p in net.parameters()),
        torch_dtype,
        device_str,
    )
    return net, cfg
