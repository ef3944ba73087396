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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine.config import EngineConfig
    from engine.model.config import ModelArchConfig

# The KV cache dtypes, by name, and their sizes. Named, not torch objects: the engine
# process plans the cache without importing torch (only its workers do).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (one of ``DTYPE_BYTES``)."""
    import torch

    if name not in DTYPE_BYTES:
        raise ValueError(f"not a KV cache dtype: {name!r} (one of {sorted(DTYPE_BYTES)})")
    return getattr(torch, name)


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    num_layers: int
    num_kv_heads: int  # per rank: ModelArchConfig.kv_head_range (1 when heads are replicated)
    block_size: int
    head_dim: int
    dtype: str  # a name in DTYPE_BYTES; a torch dtype given here is turned into its name

    def __post_init__(self) -> None:
        name = _dtype_name(self.dtype)
        if name not in DTYPE_BYTES:
            raise ValueError(f"not a KV cache dtype: {self.dtype!r} (one of {sorted(DTYPE_BYTES)})")
        object.__setattr__(self, "dtype", name)

    @classmethod
    def for_model(
        cls, arch: ModelArchConfig, config: EngineConfig, num_blocks: int = 1
    ) -> KVCacheSpec:
        """One rank's layout for ``arch`` under ``config`` (TP size, block size, dtype).

        ``config.model.dtype`` must be resolved (``EngineCore`` resolves ``auto`` first).
        """
        dtype = config.model.dtype
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"KV cache dtype must be resolved first, got {dtype!r}")
        return cls(
            num_blocks=num_blocks,
            num_layers=arch.num_hidden_layers,
            num_kv_heads=arch.num_kv_heads_per_rank(config.parallel.tp),  # kv_head_range
            block_size=config.cache.block_size,
            head_dim=arch.head_dim,
            dtype=dtype,
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
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def block_bytes(self) -> int:
        elem = DTYPE_BYTES[self.dtype]
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim * elem

    def allocate(self, device: str | torch.device = "cpu") -> torch.Tensor:
        import torch

        return torch.zeros(self.shape, dtype=self.torch_dtype, device=device)


def _dtype_name(dtype: Any) -> str:
    """``"float16"`` for ``"float16"`` and for ``torch.float16``."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
