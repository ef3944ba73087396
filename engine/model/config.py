"""Architecture description of a Llama-family decoder, parsed from an HF ``config.json``."""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from engine.config import TINY_MODEL, ConfigError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ConfigError):
    """The checkpoint's config describes something this engine cannot run (a ConfigError:
    a node start reports it in one line and exits 2, as a bad flag)."""


def _normalize_rope_scaling(
    rope_scaling: dict[str, Any] | None, arch: str
) -> dict[str, Any] | None:
    """Return a validated copy of ``rope_scaling`` or None for plain RoPE."""
    if not rope_scaling:
        return None
    scaling = dict(rope_scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    scaling["rope_type"] = rope_type
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{arch}: rope_scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if "factor" not in scaling:
        raise ModelConfigError(f"{arch}: rope_scaling {rope_type!r} needs a 'factor'")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in scaling:
                raise ModelConfigError(f"{arch}: llama3 rope_scaling is missing {key!r}")
    return scaling


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _all_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2); o_proj never has one here
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...] = ()  # all stop ids from config.json (Llama 3 lists several)
    checkpoint_dtype: str = "float32"  # the weights' dtype per config.json ('torch_dtype'/'dtype')

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], max_model_len: int | None = None) -> ModelArchConfig:
        """Parse an HF ``config.json`` dict (transformers 4.x or 5.x layout).

        ``max_model_len`` (if given) is the context length the engine will serve; a Mistral
        sliding window is only accepted when it covers that length.
        """
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(d.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        max_pos = int(d.get("max_position_embeddings", 2048))

        # transformers 5 folds rope_theta / rope_scaling into ``rope_parameters``.
        rope_params = d.get("rope_parameters") or {}
        rope_theta = float(d.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        rope_scaling = d.get("rope_scaling") or (rope_params if rope_params else None)
        rope_scaling = _normalize_rope_scaling(rope_scaling, arch)

        if arch == "Qwen2ForCausalLM":
            qkv_bias = True
            window = d.get("sliding_window") if d.get("use_sliding_window") else None
        else:
            if d.get("mlp_bias"):
                raise ModelConfigError(f"{arch}: mlp_bias=true is not supported")
            qkv_bias = bool(d.get("attention_bias", False))
            if qkv_bias:
                # Llama's attention_bias also puts a bias on o_proj, which we do not model.
                raise ModelConfigError(f"{arch}: attention_bias=true is not supported")
            window = d.get("sliding_window") if arch == "MistralForCausalLM" else None
        limit = max_model_len or max_pos
        if window is not None and int(window) < limit:
            raise ModelConfigError(
                f"{arch}: sliding_window={window} is smaller than the context length {limit}; "
                "sliding-window attention is not supported (lower --max-model-len to "
                f"<= {window} to serve this model)"
            )
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ModelConfigError(f"{arch}: hidden_act={hidden_act!r} is not supported")

        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            bos_token_id=_first_id(d.get("bos_token_id")),
            eos_token_id=_first_id(d.get("eos_token_id")),
            eos_token_ids=_all_ids(d.get("eos_token_id")),
            checkpoint_dtype=_checkpoint_dtype(d),
        )

    @classmethod
    def from_dir(cls, path: str, max_model_len: int | None = None) -> ModelArchConfig:
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ModelConfigError(f"{path!r} has no config.json")
        with open(config_path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f), max_model_len=max_model_len)

    @classmethod
    def tiny(cls) -> ModelArchConfig:
        """A small random Llama used for tests and CPU demos (byte tokenizer vocab fits)."""
        return cls(
            architecture="LlamaForCausalLM",
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling=None,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            qkv_bias=False,
            bos_token_id=256,
            eos_token_id=257,
            eos_token_ids=(257,),
        )

    def validate_tp(self, tp: int) -> None:
        """Raise ModelConfigError unless this model can run at tensor-parallel size ``tp``.

        Query heads, vocab and MLP must split evenly; the KV heads must either split evenly
        (``tp`` divides ``num_key_value_heads``) or be replicated (``tp`` a multiple of it,
        one KV head per rank; see ``kv_head_range``). The message names the valid sizes.
        """
        if tp < 1:
            raise ModelConfigError(f"tensor-parallel size must be >= 1, got {tp}")
        kv = self.num_key_value_heads
        problems = []
        if self.num_attention_heads % tp:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} is not divisible by {tp}"
            )
        if kv % tp and tp % kv:
            problems.append(
                f"num_key_value_heads={kv} neither is divisible by {tp} nor divides it "
                f"(KV heads are split when --tp divides {kv}, replicated one per rank when "
                f"--tp is a multiple of {kv})"
            )
        for name, value in (
            ("vocab_size", self.vocab_size),
            ("intermediate_size", self.intermediate_size),
        ):
            if value % tp:
                problems.append(f"{name}={value} is not divisible by {tp}")
        if problems:
            raise ModelConfigError(f"--tp {tp}: {'; '.join(problems)}; {self._valid_tp_hint()}")

    def valid_tp_sizes(self) -> list[int]:
        """Every tensor-parallel size ``validate_tp`` accepts, ascending."""
        kv = self.num_key_value_heads
        return [
            tp
            for tp in range(1, self.num_attention_heads + 1)
            if self.num_attention_heads % tp == 0
            and self.vocab_size % tp == 0
            and self.intermediate_size % tp == 0
            and (kv % tp == 0 or tp % kv == 0)
        ]

    def _valid_tp_hint(self) -> str:
        sizes = [str(t) for t in self.valid_tp_sizes()]
        listed = sizes[0] if len(sizes) == 1 else ", ".join(sizes[:-1]) + " or " + sizes[-1]
        return f"use --tp {listed} for this model"

    def kv_head_range(self, rank: int, tp: int) -> tuple[int, int]:
        """The model's KV heads that TP rank ``rank`` of ``tp`` holds: ``(first global head,
        count)``; the rank holds heads ``first .. first + count - 1``.

        With ``H = num_key_value_heads``:

        - ``tp <= H`` (``tp`` divides ``H``): the heads are split, ``(rank * H // tp, H // tp)``;
        - ``tp > H`` (``tp`` a multiple of ``H``): the heads are replicated as in vLLM's
          ``QKVParallelLinear``: every rank holds exactly one, ``(rank // (tp // H), 1)``, so
          ``tp // H`` consecutive ranks hold the same head.

        Query heads are always split evenly (rank ``r`` holds ``num_attention_heads // tp``
        heads from ``r * num_attention_heads // tp``), and they all belong to the rank's KV
        heads. This one mapping decides the heads of a rank's KV cache (``KVCacheSpec``), its
        attention layer and the k/v projection rows (weight and bias) it loads, and it is the
        mapping a KV connector needs to pair prefill ranks with decode ranks of another TP size.

        Raises ModelConfigError when ``tp`` is not a valid size (``validate_tp``) and
        ValueError when ``rank`` is not in ``[0, tp)``.
        """
        self.validate_tp(tp)
        if not 0 <= rank < tp:
            raise ValueError(f"tp rank {rank} out of range for tp size {tp}")
        kv = self.num_key_value_heads
        if tp <= kv:
            per_rank = kv // tp
            return rank * per_rank, per_rank
        return rank // (tp // kv), 1

    def num_kv_heads_per_rank(self, tp: int) -> int:
        """KV heads on every rank at ``tp`` (1 when the heads are replicated)."""
        return self.kv_head_range(0, tp)[1]

    def num_heads_per_rank(self, tp: int) -> int:
        self.validate_tp(tp)
        return self.num_attention_heads // tp


def _checkpoint_dtype(d: dict[str, Any]) -> str:
    value = d.get("torch_dtype") or d.get("dtype") or "float32"
    value = str(value).removeprefix("torch.")
    return value if value in ("float32", "bfloat16", "float16") else "float32"


def resolve_dtype(requested: str, device: str, arch: ModelArchConfig) -> str:
    """``--dtype auto``: the checkpoint's dtype, but bf16 instead of fp32 on CUDA and fp32 on
    CPU (half-precision matmuls are slow there); an explicit dtype is kept."""
    if requested != "auto":
        return requested
    if device != "cuda":
        return "float32"
    return "bfloat16" if arch.checkpoint_dtype == "float32" else arch.checkpoint_dtype


def _arch_from_model_type(model_type: str | None) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
    }.get(model_type or "", str(model_type))


def checkpoint_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files (its index's shards, else ``*.safetensors``);
    ModelConfigError when it has none. No torch: the engine process checks before its
    workers start, the workers load from them."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ModelConfigError(f"{model_dir!r} has no *.safetensors weights")
    return files


def load_arch_config(model: str, max_model_len: int | None = None) -> ModelArchConfig:
    """Read just the architecture: ``ModelArchConfig.tiny()`` or ``<dir>/config.json``
    (no torch needed: the engine process plans with it; workers load the weights)."""
    if model == TINY_MODEL:
        return ModelArchConfig.tiny()
    if not os.path.isdir(model):
        raise ModelConfigError(f"model {model!r} is neither 'tiny' nor a checkpoint directory")
    return ModelArchConfig.from_dir(model, max_model_len=max_model_len)
