"""``pd-bench make-model``: a random Hugging Face Llama / Qwen2 checkpoint for benchmarks.

The directory holds what ``--model DIR`` needs: ``config.json``, ``*.safetensors``
(the layout transformers ``save_pretrained`` writes, written directly: transformers is not
imported, which alone is seconds of CPU) and a ``tokenizer.json`` with one token per word
of ``WORDS`` and per ASCII character (pdserve nodes load a checkpoint's tokenizer at
startup, so one is always written; structured outputs need one llguidance can use). Weights are
drawn with std 0.02 (sane activations at any depth) and the LM head is scaled so greedy
choices are not near-ties (a float32 run matches transformers token for token).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from engine.bench.words import WORDS

LM_HEAD_SCALE = 20.0
INIT_STD = 0.02
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
GENERATION_CONFIG = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": 0}


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # "llama" or "qwen2"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_position_embeddings: int
    dtype: str  # float32 | bfloat16 | float16
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    def num_params(self) -> int:
        """Parameter count (embeddings and LM head included)."""
        return sum(math.prod(shape) for _, shape in parameter_shapes(self))


PRESETS: dict[str, ModelSpec] = {
    # ~886M parameters: the size the GPU targets in docs/performance.md are stated for.
    "llama-886m": ModelSpec(
        arch="llama",
        layers=16,
        hidden=2048,
        heads=16,
        kv_heads=8,
        head_dim=128,
        intermediate=5632,
        vocab=32000,
        max_position_embeddings=16384,
        dtype="bfloat16",
    ),
    # Seconds to write and run on a CPU; for smoke tests.
    "tiny-llama": ModelSpec(
        arch="llama",
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        vocab=512,
        max_position_embeddings=2048,
        dtype="float32",
    ),
}
PRESETS["tiny-qwen2"] = dataclasses.replace(PRESETS["tiny-llama"], arch="qwen2")

# flag -> ModelSpec field
OVERRIDES = {
    "arch": ("arch", str),
    "layers": ("layers", int),
    "hidden": ("hidden", int),
    "heads": ("heads", int),
    "kv_heads": ("kv_heads", int),
    "head_dim": ("head_dim", int),
    "intermediate": ("intermediate", int),
    "vocab": ("vocab", int),
    "max_position_embeddings": ("max_position_embeddings", int),
    "rope_theta": ("rope_theta", float),
}


def add_make_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory to write (created)")
    p.add_argument(
        "--preset", choices=sorted(PRESETS), default="tiny-llama", help="(default: tiny-llama)"
    )
    p.add_argument("--arch", choices=["llama", "qwen2"], help="override the preset's family")
    for name, (_, tp) in OVERRIDES.items():
        if name == "arch":
            continue
        p.add_argument("--" + name.replace("_", "-"), type=tp, help="override the preset")
    p.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, help="override")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    p.add_argument(
        "--lm-head-scale",
        type=float,
        default=LM_HEAD_SCALE,
        help=f"LM head multiplier, widens logit gaps (default: {LM_HEAD_SCALE})",
    )
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    spec = PRESETS[args.preset]
    changes: dict[str, Any] = {}
    for name, (fld, _) in OVERRIDES.items():
        value = getattr(args, name, None)
        if value is not None:
            changes[fld] = value
    if getattr(args, "dtype", None):
        changes["dtype"] = args.dtype
    if getattr(args, "tie_word_embeddings", None) is not None:
        changes["tie_word_embeddings"] = args.tie_word_embeddings
    spec = replace(spec, **changes)
    if spec.heads % spec.kv_heads:
        raise ValueError(f"--heads {spec.heads} is not a multiple of --kv-heads {spec.kv_heads}")
    if spec.vocab <= len(SPECIAL_TOKENS):
        raise ValueError(f"--vocab must be > {len(SPECIAL_TOKENS)}")
    return spec


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The checkpoint's ``config.json``: what transformers ``save_pretrained`` writes for
    the architecture (transformers 4.x reads ``rope_theta``, 5.x ``rope_parameters``;
    fields left out take transformers' defaults)."""
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[spec.arch]],
        "model_type": spec.arch,
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "initializer_range": INIT_STD,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": None,
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": spec.dtype,
        "torch_dtype": spec.dtype,
    }
    if spec.arch == "llama":
        config |= {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    else:
        config |= {"use_sliding_window": False, "sliding_window": None}
    return config


def parameter_shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Each parameter's name and shape, in transformers' ``named_parameters`` order (the
    order the weights are drawn in); a tied LM head is not a parameter of its own."""
    h, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (spec.vocab, h))]
    for i in range(spec.layers):
        pre = f"model.layers.{i}."
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes.append((f"{pre}self_attn.{proj}.weight", (rows, h)))
            if spec.arch == "qwen2":
                shapes.append((f"{pre}self_attn.{proj}.bias", (rows,)))
        shapes.append((f"{pre}self_attn.o_proj.weight", (h, q)))
        shapes.append((f"{pre}mlp.gate_proj.weight", (spec.intermediate, h)))
        shapes.append((f"{pre}mlp.up_proj.weight", (spec.intermediate, h)))
        shapes.append((f"{pre}mlp.down_proj.weight", (h, spec.intermediate)))
        shapes.append((f"{pre}input_layernorm.weight", (h,)))
        shapes.append((f"{pre}post_attention_layernorm.weight", (h,)))
    shapes.append(("model.norm.weight", (h,)))
    if not spec.tie_word_embeddings:
        shapes.append(("lm_head.weight", (spec.vocab, h)))
    return shapes


def build_weights(
    spec: ModelSpec, seed: int = 0, lm_head_scale: float = LM_HEAD_SCALE
) -> dict[str, Any]:
    """The random weights by name, in ``spec.dtype`` on the CPU: N(0, 0.02) drawn in
    float32 from one generator in parameter order, norms 1, the LM head (or, when tied,
    the final norm) times ``lm_head_scale``."""
    import torch

    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in parameter_shapes(spec):
        if "norm" in name:
            weights[name] = torch.ones(shape, dtype=dtype)
        else:
            weights[name] = (torch.randn(shape, generator=gen) * INIT_STD).to(dtype)
    head = "model.norm.weight" if spec.tie_word_embeddings else "lm_head.weight"
    weights[head].mul_(lm_head_scale)
    return weights


# One token per printable ASCII character (a space is METASPACE), so any ASCII text
# encodes, one character a token where no word fits (a JSON object, a regex's match).
METASPACE = "\u2581"
CHARS = (METASPACE, *(chr(c) for c in range(33, 127)))


def vocab_words(vocab: int) -> list[str]:
    """Token strings: the special tokens, the characters, then ``WORDS`` and ``t<id>``
    fillers, each a word with its leading space (``METASPACE``)."""
    words = [*SPECIAL_TOKENS, *CHARS, *(METASPACE + w for w in WORDS)][:vocab]
    words += [f"{METASPACE}t{i}" for i in range(len(words), vocab)]
    return words


def write_tokenizer(out: str, vocab: int, max_len: int) -> None:
    """A SentencePiece-style ``tokenizer.json`` (unigram, as Llama 2's decodes) with one
    token per model id: a text's words are one token each (``"the city"`` is ``▁the``,
    ``▁city``), anything else one token per ASCII character (``<unk>`` past ASCII). Its
    encoding is lossless for ASCII text, as llguidance needs for structured outputs (it
    tokenizes the text a grammar forces); a word-level one was not."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import Unigram

    words = vocab_words(vocab)
    n_special = len(SPECIAL_TOKENS)
    # Log-probabilities: a word beats spelling it out; a special token is never picked.
    scores = [0.0] * n_special + [-10.0 if len(w) == 1 else -1.0 for w in words[n_special:]]
    tok = Tokenizer(Unigram(list(zip(words, scores, strict=True)), unk_id=0))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(METASPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(os.path.join(out, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "model_max_length": max_len,
    }
    _write_json(out, "tokenizer_config.json", cfg)


def _write_json(out: str, name: str, data: dict[str, Any]) -> None:
    with open(os.path.join(out, name), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def make_model(
    out: str,
    spec: ModelSpec,
    seed: int = 0,
    lm_head_scale: float = LM_HEAD_SCALE,
    force: bool = False,
) -> dict[str, Any]:
    """Write the checkpoint to ``out``; returns a description (also in ``pd_bench.json``)."""
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise FileExistsError(f"{out!r} is not empty (use --force to write into it)")
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    from safetensors.torch import save_file

    weights = build_weights(spec, seed, lm_head_scale)
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    _write_json(out, "config.json", hf_config(spec))
    _write_json(out, "generation_config.json", GENERATION_CONFIG)
    write_tokenizer(out, spec.vocab, spec.max_position_embeddings)
    info = {
        "spec": asdict(spec),
        "num_params": sum(w.numel() for w in weights.values()),
        "seed": seed,
        "lm_head_scale": lm_head_scale,
        "init_std": INIT_STD,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    with open(os.path.join(out, "pd_bench.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(out):  # safetensors may be written 0600; readable like the rest
        path = os.path.join(out, name)
        if os.path.isfile(path):
            os.chmod(path, 0o666 & ~umask)
    return info


def run_make_model(args: argparse.Namespace) -> int:
    try:
        spec = spec_from_args(args)
        info = make_model(args.out, spec, args.seed, args.lm_head_scale, args.force)
    except (ValueError, FileExistsError) as e:
        print(f"pd-bench make-model: error: {e}")
        return 2
    n = info["num_params"]
    print(
        f"wrote {args.out}: {spec.arch} {spec.layers} layers, hidden {spec.hidden}, "
        f"{spec.heads}/{spec.kv_heads} heads x {spec.head_dim}, intermediate "
        f"{spec.intermediate}, vocab {spec.vocab}, {spec.dtype}, {n / 1e6:.1f}M params "
        f"({info['seconds']:.1f}s)"
    )
    return 0
