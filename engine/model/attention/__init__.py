"""Attention backends over the paged KV cache.

A backend writes the step's new K/V into the cache and attends the step's queries, for a
whole flattened batch of prefills, prefill chunks and decodes at once::

    forward(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], kv_cache, layer, attn, scale)
        -> [T, Hq, D]

``kv_cache`` is one rank's ``[num_blocks, num_layers, 2, Hkv, block_size, D]`` tensor (the
layout the transfer path moves a block of as one byte range); a backend reads layer
``layer`` of it in place as a strided view. ``attn`` is the step's ``AttentionMetadata``.

- ``reference`` (``reference.py``): per-sequence SDPA, the definition of correct; CPU and
  tests.
- ``triton`` (``triton_backend.py``): our Triton kernels, one launch per layer for the
  whole batch, no host syncs, CUDA-graph safe; checked against the reference on CPU
  tensors with ``TRITON_INTERPRET=1``.

``get_attention_backend("auto", device)`` picks triton on CUDA and the reference elsewhere.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.model.attention.metadata import AttentionMetadata, PackedStep, StepInputs, pack_step

BACKENDS = ("auto", "reference", "triton")


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend called ``name`` (one of ``BACKENDS``) for tensors on ``device``."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "reference"
    if name == "reference":
        from engine.model.attention.reference import ReferenceAttentionBackend

        return ReferenceAttentionBackend()
    if name == "triton":
        from engine.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(BACKENDS)})")


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "PackedStep",
    "StepInputs",
    "pack_step",
    "get_attention_backend",
]
