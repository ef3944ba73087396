"""The fast attention backend: our Triton kernels (``triton_kernels.py``).

Per layer, two launches for the whole batch: ``reshape_and_cache`` writes the step's K/V
at the slot mapping, ``unified_attention`` attends every query row of every sequence
(prefills, chunks over a cached prefix and decodes alike) straight from the paged cache.
Only device tensors of the metadata and host ints known without a sync are used, so the
forward never reads a device value back and a decode step can be captured in a CUDA
graph.
"""

from __future__ import annotations

import torch

from engine.model.attention.metadata import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"

    def __init__(self) -> None:
        from engine.model.attention import triton_kernels  # imports triton

        self._kernels = triton_kernels

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        kernels = self._kernels
        kernels.reshape_and_cache(k, v, kv_cache, layer, attn.slot_mapping)
        return kernels.unified_attention(
            q,
            kv_cache,
            layer,
            attn.query_start_loc,
            attn.seq_lens_tensor,
            attn.block_tables,
            attn.max_query_len,
            scale,
        )
