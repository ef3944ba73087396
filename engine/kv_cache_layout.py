"""The paged KV cache layout of one TP rank.

One tensor per rank::

    # [num_blocks, num_layers, 2 (k, v), num_kv_heads_local, block_size, head_dim]

A block is the leading index, so one block of one rank -- all layers, K and V -- is a
single contiguous byte range, and a run of consecutive block ids is one range too. The
transfer path (kvconnector) moves a run of blocks as one descriptor. Within a block and
layer, a head's tokens are contiguous (HND), so a contiguous head range can later be
sliced out for heterogeneous TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model.config import ModelArchConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    num_layers: int
    num_kv_heads: int  # per rank: ModelArchConfig.kv_head_range (1 when heads are replicated)
    block_size: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def for_model(
        cls, arch: ModelArchConfig, config: EngineConfig, num_blocks: int = 1
    ) -> KVCacheSpec:
        """One rank's layout for ``arch`` under ``config`` (TP size, block size, dtype).

        ``config.model.dtype`` must be resolved (``EngineCore`` resolves ``auto`` first).
        """
        dtype = config.model.dtype
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"KV cache dtype must be resolved first, got {dtype!r}")
        return cls(
            num_blocks=num_blocks,
            num_layers=arch.num_hidden_layers,
            num_kv_heads=arch.num_kv_heads_per_rank(config.parallel.tp),  # kv_head_range
            block_size=config.cache.block_size,
            head_dim=arch.head_dim,
            dtype=TORCH_DTYPES[dtype],
        )

    @property
    def shape(self) -> tuple[int, ...]:
        return (
            self.num_blocks,
            self.num_layers,
            2,
            self.num_kv_heads,
            self.block_size,
            self.head_dim,
        )

    @property
    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim * elem

    def allocate(self, device: str | torch.device = "cpu") -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=device)
