"""Runs the model on one TP rank: builds the flattened batch, forwards, samples."""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.core.scheduler_output import SchedulerOutput
from engine.kv_cache_layout import KVCacheSpec
from engine.model.attention_metadata import AttentionMetadata
from engine.model.loader import load_model
from engine.worker.sampler import Sampler

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(
        self, config: EngineConfig, rank: int, world_size: int, num_blocks: int, device: str
    ) -> None:
        self.rank = rank
        self.device = torch.device(device)
        dtype = DTYPES[config.model.dtype]
        self.model, self.arch = load_model(
            config.model.model, rank, world_size, dtype, self.device, config.model.seed
        )
        self.block_size = config.cache.block_size
        self.kv_spec = KVCacheSpec(
            num_blocks=num_blocks,
            num_layers=self.arch.num_hidden_layers,
            num_kv_heads=self.arch.num_key_value_heads // world_size,
            block_size=self.block_size,
            head_dim=self.arch.head_dim,
            dtype=dtype,
        )
        # [num_blocks, num_layers, 2, kv_heads_local, block_size, head_dim]
        self.kv_cache = self.kv_spec.allocate(self.device)
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[str, int]:
        """Forward the step's tokens; returns sampled tokens (rank 0 only, else {})."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, query_start, tables = [], [], [], []
        for seq in sched.seqs:
            query_start.append(len(ids))
            ids.extend(seq.token_ids)
            pos = range(seq.start_pos, seq.start_pos + seq.num_tokens)
            positions.extend(pos)
            slots.extend(seq.block_ids[p // bs] * bs + p % bs for p in pos)
            query_lens.append(seq.num_tokens)
            seq_lens.append(seq.start_pos + seq.num_tokens)
            tables.append(torch.tensor(seq.block_ids, dtype=torch.long, device=self.device))
        attn = AttentionMetadata(
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start=query_start,
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_size=bs,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, pos_t, attn, self.kv_cache)  # [num_tokens, hidden]

        rows = [
            query_start[i] + query_lens[i] - 1
            for i, seq in enumerate(sched.seqs)
            if seq.sampling_params is not None
        ]
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[rows])  # [num_sampled, vocab], all ranks
        if self.rank != 0:
            return {}
        sampled = [s for s in sched.seqs if s.sampling_params is not None]
        tokens = self.sampler.sample(
            logits.float().cpu(),
            [s.sampling_params for s in sampled],  # type: ignore[misc]
            [s.start_pos + s.num_tokens for s in sampled],
        )
        return {s.request_id: t for s, t in zip(sampled, tokens, strict=True)}
