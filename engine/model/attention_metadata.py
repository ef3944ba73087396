"""Per-step attention inputs shared by the model runner and the attention layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes the flattened batch of one forward pass.

    Tokens of all scheduled sequences are concatenated: sequence ``i`` owns rows
    ``query_start[i] : query_start[i] + query_lens[i]`` of the hidden states.
    Its new tokens sit at positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``
    and attend causally to all ``seq_lens[i]`` tokens of the sequence, whose K/V live in
    the paged cache at ``block_tables[i]``.
    """

    query_lens: list[int]  # new tokens per sequence this step
    seq_lens: list[int]  # context length per sequence after this step
    query_start: list[int]  # row offset of each sequence in the flattened batch
    block_tables: list[torch.Tensor]  # per sequence: [num_blocks_of_seq] int64 block ids
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)
