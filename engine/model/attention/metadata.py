"""Per-step attention inputs, built once on the host and copied to the device in one transfer.

The batch of one forward pass is flattened: the new tokens of all scheduled sequences are
concatenated, sequence ``i`` owning rows ``query_start[i] : query_start[i] + query_lens[i]``.
Its new tokens sit at positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`` and attend
causally to all ``seq_lens[i]`` tokens of the sequence, whose K/V live in the paged cache at
``block_tables[i]``. A prefill, a prefill chunk and a decode are the same thing here
(``query_lens[i]`` of 1 is a decode).

Backends read the device tensors only; the host lists are for the reference backend and the
model runner (CUDA-graph bucket choice). Nothing in the forward reads a device value back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    # Host side (Python ints).
    query_lens: list[int]  # new tokens per sequence this step
    seq_lens: list[int]  # context length per sequence after this step
    query_start: list[int]  # row offset of each sequence in the flattened batch
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Device side.
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset; < 0 = not written
    query_start_loc: torch.Tensor  # [S + 1] int32: query_start plus the total token count
    seq_lens_tensor: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32; a row is 0-padded past its blocks

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass
class StepInputs:
    """Everything the forward of one step needs, on the device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata


@dataclass
class PackedStep:
    """One step's inputs flattened on the host into a single int64 buffer.

    Layout: ``[ids T | positions T | slots T | query_start_loc S+1 | seq_lens S | tables S*W]``.
    Copying ``buffer`` is the step's only host-to-device transfer; ``unpack`` slices the
    device copy (so a CUDA graph can capture the unpacking of a static buffer).
    """

    buffer: torch.Tensor  # [T * 3 + S * (W + 2) + 1] int64, on the host
    num_tokens: int
    num_seqs: int
    width: int  # block-table columns
    block_size: int
    query_lens: list[int]
    seq_lens: list[int]
    query_start: list[int]

    def unpack(self, dev: torch.Tensor) -> StepInputs:
        """Slice ``dev`` (this step's buffer, on the device) into the forward's inputs."""
        t, s, w = self.num_tokens, self.num_seqs, self.width
        ids, pos, slots, qsl, seq, tables = dev[: self.buffer.numel()].split(
            [t, t, t, s + 1, s, s * w]
        )
        attn = AttentionMetadata(
            query_lens=self.query_lens,
            seq_lens=self.seq_lens,
            query_start=self.query_start,
            max_query_len=max(self.query_lens, default=0),
            max_seq_len=max(self.seq_lens, default=0),
            block_size=self.block_size,
            slot_mapping=slots,
            query_start_loc=qsl.to(torch.int32),
            seq_lens_tensor=seq.to(torch.int32),
            block_tables=tables.view(s, w).to(torch.int32),
        )
        return StepInputs(input_ids=ids, positions=pos, attn=attn)

    def to_device(self, device: torch.device) -> StepInputs:
        """A plain (synchronous) copy; the model runner stages through pinned memory."""
        return self.unpack(self.buffer.to(device))


def pack_step(
    token_ids: list[list[int]],
    start_positions: list[int],
    block_ids: Sequence[Sequence[int] | np.ndarray],
    block_size: int,
    width: int | None = None,
    pad_seqs: int = 0,
) -> PackedStep:
    """Flatten one step's sequences: ``token_ids[i]`` are sequence ``i``'s new tokens, at
    positions ``start_positions[i] ..``; ``block_ids[i]`` is its block table.

    ``width`` fixes the block-table width (CUDA-graph buffers; default: the widest table).
    ``pad_seqs`` appends that many padding sequences of one token each (a CUDA-graph batch
    bucket): position 0, no slot (``-1``, never written), context length 0.
    """
    real = len(token_ids)
    num_seqs = real + pad_seqs
    query_lens = np.ones(num_seqs, dtype=np.int64)
    query_lens[:real] = [len(t) for t in token_ids]
    starts = np.zeros(num_seqs, dtype=np.int64)
    starts[:real] = start_positions
    seq_lens = starts + query_lens
    seq_lens[real:] = 0
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    real_tokens = int(query_start_loc[real])
    # positions[t] = start of t's sequence + t's offset within it
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
        query_start_loc[:-1] - starts, query_lens
    )
    positions[real_tokens:] = 0
    if width is None:
        width = max((len(b) for b in block_ids), default=0)
    width = max(width, 1)
    tables = np.zeros((num_seqs, width), dtype=np.int64)
    for i, blocks in enumerate(block_ids):
        tables[i, : len(blocks)] = blocks
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)  # [T]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    slots[real_tokens:] = -1
    ids = np.zeros(num_tokens, dtype=np.int64)
    ids[:real_tokens] = [t for toks in token_ids for t in toks]
    buffer = np.concatenate([ids, positions, slots, query_start_loc, seq_lens, tables.reshape(-1)])
    return PackedStep(
        buffer=torch.from_numpy(buffer),
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        width=width,
        block_size=block_size,
        query_lens=query_lens.tolist(),
        seq_lens=seq_lens.tolist(),
        query_start=query_start_loc[:-1].tolist(),
    )
