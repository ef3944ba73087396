"""Tensor-parallel linear and embedding layers on ``torch.distributed``.

Every layer holds only its rank's shard. Shards are filled through ``load_shard(reader, part)``
where ``reader(dim, start, end)`` returns ``full_tensor.narrow(dim, start, end - start)``
(``dim=None``: the whole tensor), so a loader can read just the rank's slice from disk.

With a TP size of 1 no ``torch.distributed`` function is ever called.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

ShardReader = Callable[[int | None, int, int], torch.Tensor]

_TP_STATE: dict[str, int] = {}


def init_tp(rank: int, world_size: int) -> None:
    """Record this process's TP rank and size (the process group is set up by the caller)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"tp rank {rank} out of range for tp size {world_size}")
    _TP_STATE["rank"] = rank
    _TP_STATE["world_size"] = world_size


def get_tp_rank() -> int:
    if "rank" in _TP_STATE:
        return _TP_STATE["rank"]
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_tp_size() -> int:
    if "world_size" in _TP_STATE:
        return _TP_STATE["world_size"]
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _needs_fp32_comm(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)


def tp_all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum ``x`` over the TP group (identity for tp_size 1)."""
    if tp_size == 1:
        return x
    if _needs_fp32_comm(x):  # gloo reduces half types poorly (or not at all)
        y = x.float()
        dist.all_reduce(y)
        return y.to(x.dtype)
    x = x.contiguous()
    dist.all_reduce(x)
    return x


def tp_broadcast_(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``t`` into every rank's ``t`` (in place, on the tensor's device; no host
    read), over the TP group."""
    dist.broadcast(t, src=0)
    return t


def tp_all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Concatenate each rank's ``x`` along the last dim, in rank order."""
    if tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def _copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{what}: checkpoint shard shape {tuple(src.shape)} != expected {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


def load_replicated(param: torch.Tensor, reader: ShardReader, what: str) -> None:
    """Load a parameter every rank holds in full (norm weights, row-parallel bias)."""
    _copy_into(param, reader(None, 0, 0), what)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T (+ b)`` with W's output rows split across ranks; output stays sharded.

    ``output_sizes`` lists the fused parts (e.g. [q, k, v] or [gate, up]); each part is split
    across ranks separately, and the local weight is ``[part0_local; part1_local; ...]``.
    ``shards`` (optional) gives, per part, the rows ``(start, count)`` of the full part this
    rank holds, for parts not split evenly: the k/v parts when KV heads are replicated
    (``ModelArchConfig.kv_head_range``); by default rank ``r`` holds
    ``(r * size // tp, size // tp)`` of every part.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shards: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        if shards is None:
            for size in output_sizes:
                if size % tp_size != 0:
                    raise ValueError(f"output size {size} not divisible by tp size {tp_size}")
            shards = [(tp_rank * (s // tp_size), s // tp_size) for s in output_sizes]
        if len(shards) != len(output_sizes):
            raise ValueError(f"{len(shards)} shards for {len(output_sizes)} output parts")
        for size, (start, count) in zip(output_sizes, shards, strict=True):
            if start < 0 or count < 1 or start + count > size:
                raise ValueError(f"shard rows [{start}, {start + count}) outside a part of {size}")
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.shards = [(int(start), int(count)) for start, count in shards]
        self.local_sizes = [count for _, count in self.shards]
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        local_out = sum(self.local_sizes)
        self.weight = nn.Parameter(
            torch.empty(local_out, input_size, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(local_out, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def load_shard(self, param_name: str, reader: ShardReader, part: int = 0) -> None:
        """Load part ``part`` of ``weight``/``bias`` from its full checkpoint tensor."""
        start, local = self.shards[part]
        offset = sum(self.local_sizes[:part])
        param = self.weight if param_name == "weight" else self.bias
        if param is None:
            raise ValueError("checkpoint has a bias for a layer built without one")
        _copy_into(param.narrow(0, offset, local), reader(0, start, start + local), param_name)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns split across ranks; the input is sharded and
    the partial products are summed with an all-reduce (bias added once, after it)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        if input_size % tp_size != 0:
            raise ValueError(f"input size {input_size} not divisible by tp size {tp_size}")
        self.input_size_local = input_size // tp_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_local, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.bias = (
            nn.Parameter(torch.empty(output_size, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(nn.functional.linear(x, self.weight), self.tp_size)
        return y if self.bias is None else y + self.bias

    def load_shard(self, param_name: str, reader: ShardReader, part: int = 0) -> None:
        if param_name == "bias":
            if self.bias is None:
                raise ValueError("checkpoint has a bias for a layer built without one")
            _copy_into(self.bias, reader(None, 0, 0), "bias")
            return
        start = self.tp_rank * self.input_size_local
        _copy_into(self.weight, reader(1, start, start + self.input_size_local), "weight")


class _VocabShard(nn.Module):
    """A [vocab_local, hidden] weight holding this rank's contiguous slice of the vocab."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        if vocab_size % tp_size != 0:
            raise ValueError(f"vocab size {vocab_size} not divisible by tp size {tp_size}")
        self.vocab_size = vocab_size
        self.vocab_local = vocab_size // tp_size
        self.vocab_start = tp_rank * self.vocab_local
        self.tp_size = tp_size
        self.weight = nn.Parameter(
            torch.empty(self.vocab_local, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )

    def load_shard(self, param_name: str, reader: ShardReader, part: int = 0) -> None:
        end = self.vocab_start + self.vocab_local
        _copy_into(self.weight, reader(0, self.vocab_start, end), param_name)


class VocabParallelEmbedding(_VocabShard):
    """Embedding table split by vocab rows; out-of-shard ids give zeros, then all-reduce."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.vocab_local)
        emb = nn.functional.embedding(local_ids.masked_fill(outside, 0), self.weight)
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)  # [T, H]
        return tp_all_reduce(emb, self.tp_size)


class ParallelLMHead(_VocabShard):
    """Output projection split by vocab rows; logits are all-gathered to the full vocab."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's shard (same vocab split on both sides)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(hidden, self.weight).float()  # [S, vocab_local]
        return tp_all_gather_last_dim(logits, self.tp_size)  # [S, vocab]
