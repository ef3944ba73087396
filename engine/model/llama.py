"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) with tensor parallelism and a paged KV cache.

Each module holds only its TP rank's shard; ``load_weights`` fills them from HF-named
checkpoint tensors through a reader that can fetch just the needed slice.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch
from torch import nn

from engine.model.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from engine.model.config import ModelArchConfig
from engine.model.ops import ModelOps, get_model_ops
from engine.model.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    ShardReader,
    VocabParallelEmbedding,
    load_replicated,
)
from engine.model.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

# HF name -> a getter for a reader of that tensor; supplied by the loader.
ReaderFactory = Callable[[str], ShardReader]


class RMSNorm(nn.Module):
    """HF Llama's RMSNorm; ``add`` folds the residual add in (one launch with Triton ops)."""

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: str, ops: ModelOps
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        layer_idx: int,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        device: str,
        backend: AttentionBackend,
        ops: ModelOps,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.ops = ops
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_heads_per_rank(tp_size)
        # This rank's KV heads: a split of them, or one replicated head when tp > KV heads.
        first_kv_head, self.num_kv_heads = cfg.kv_head_range(tp_rank, tp_size)
        self.scale = cfg.head_dim**-0.5
        d = cfg.head_dim
        q_size = cfg.num_attention_heads * d
        kv_size = cfg.num_key_value_heads * d
        q_rows = (tp_rank * self.num_heads * d, self.num_heads * d)
        kv_rows = (first_kv_head * d, self.num_kv_heads * d)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [q_size, kv_size, kv_size],
            cfg.qkv_bias,
            tp_rank,
            tp_size,
            dtype,
            device,
            shards=[q_rows, kv_rows, kv_rows],
        )
        self.o_proj = RowParallelLinear(
            q_size, cfg.hidden_size, False, tp_rank, tp_size, dtype, device
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q_local, kv_local = self.qkv_proj.local_sizes[0], self.qkv_proj.local_sizes[1]
        q, k, v = self.qkv_proj(x).split([q_local, kv_local, kv_local], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self.ops.rotary(rope, q, k)
        out = self.backend.forward(q, k, v, kv_cache, self.layer_idx, attn, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))  # [T, H]


class LlamaMLP(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        device: str,
        ops: ModelOps,
    ) -> None:
        super().__init__()
        self.ops = ops
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, [inter, inter], False, tp_rank, tp_size, dtype, device
        )
        self.down_proj = RowParallelLinear(
            inter, cfg.hidden_size, False, tp_rank, tp_size, dtype, device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * inter / tp]: gate, then up
        return self.down_proj(self.ops.silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        layer_idx: int,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        device: str,
        backend: AttentionBackend,
        ops: ModelOps,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            cfg, layer_idx, tp_rank, tp_size, dtype, device, backend, ops
        )
        self.mlp = LlamaMLP(cfg, tp_rank, tp_size, dtype, device, ops)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, residual)``: the layer's output is their sum, which the next norm adds
        (HF's ``h = x + attn(norm(x)); out = h + mlp(norm(h))``, the adds folded into the
        norms). ``residual`` is None for the first layer, whose ``x`` is the embeddings."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, rope, attn, kv_cache)
        h, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF suffix inside a layer -> (module path, param name, fused part index)
_LAYER_PARAMS: dict[str, tuple[str, str, int]] = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj", "weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj", "weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj", "weight", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj", "bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj", "bias", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj", "bias", 2),
    "self_attn.o_proj.weight": ("self_attn.o_proj", "weight", 0),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj", "weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj", "weight", 1),
    "mlp.down_proj.weight": ("mlp.down_proj", "weight", 0),
    "input_layernorm.weight": ("input_layernorm", "weight", -1),
    "post_attention_layernorm.weight": ("post_attention_layernorm", "weight", -1),
}


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], attn, kv_cache) -> hidden [T, H]`` (final-normed);
    ``compute_logits(hidden [S, H]) -> [S, vocab]`` float32, full vocab on every rank."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        cfg.validate_tp(tp_size)
        self.attn_backend = get_attention_backend(attention_backend, device)
        self.ops = get_model_ops(self.attn_backend.name)
        self.config = cfg
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, tp_rank, tp_size, dtype, device
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, tp_rank, tp_size, dtype, device, self.attn_backend, self.ops)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, self.ops)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, tp_rank, tp_size, dtype, device
        )
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """``after_layer(i)``: called once layer ``i`` has written its KV (the pipelined
        push posts a piece there)."""
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary.cos_sin(positions)  # once per step, shared by all layers
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, attn, kv_cache)
            if after_layer is not None:
                after_layer(i)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [S, vocab] float32

    def load_weights(self, names: list[str], reader_for: ReaderFactory) -> None:
        """Fill every parameter from the HF-named tensors in ``names``; raise if any is missing."""
        loaded: set[str] = set()
        for name in names:
            target = self._resolve(name)
            if target is None:
                logger.debug("ignoring checkpoint tensor %s", name)
                continue
            module, param_name, part = target
            reader = reader_for(name)
            if part < 0:
                load_replicated(getattr(module, param_name), reader, name)
            else:
                module.load_shard(param_name, reader, part)
            loaded.add(name)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        elif "lm_head.weight" not in loaded and "model.embed_tokens.weight" in loaded:
            logger.warning("checkpoint has no lm_head.weight; tying it to the embeddings")
            self.lm_head.tie_to(self.embed_tokens)
            loaded.add("lm_head.weight")
        missing = sorted(set(self.expected_weight_names()) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")

    def expected_weight_names(self) -> list[str]:
        cfg = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        suffixes = [s for s in _LAYER_PARAMS if cfg.qkv_bias or not s.endswith("proj.bias")]
        for i in range(cfg.num_hidden_layers):
            names.extend(f"model.layers.{i}.{s}" for s in suffixes)
        return names

    def _resolve(self, name: str) -> tuple[nn.Module, str, int] | None:
        if name == "model.embed_tokens.weight":
            return self.embed_tokens, "weight", 0
        if name == "model.norm.weight":
            return self.norm, "weight", -1
        if name == "lm_head.weight":
            return None if self.config.tie_word_embeddings else (self.lm_head, "weight", 0)
        match = _LAYER_RE.match(name)
        if match is None:
            return None
        layer_idx, suffix = int(match.group(1)), match.group(2)
        if layer_idx >= len(self.layers) or suffix not in _LAYER_PARAMS:
            return None
        path, param_name, part = _LAYER_PARAMS[suffix]
        return self.layers[layer_idx].get_submodule(path), param_name, part
