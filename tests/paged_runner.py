"""A minimal paged-KV driver for model tests: sequential block allocation, greedy decoding.

Not used by the engine; it builds ``AttentionMetadata`` the way a model runner would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kv_cache_layout import KVCacheSpec
from engine.model.attention import pack_step
from engine.model.config import ModelArchConfig
from engine.model.llama import LlamaForCausalLM


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)


class PagedRunner:
    """Drives ``model`` over a private KV cache for any number of sequences."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        cfg: ModelArchConfig,
        num_blocks: int,
        block_size: int = 16,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        spec = KVCacheSpec(
            num_blocks=num_blocks,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_kv_heads_per_rank(tp_size),
            block_size=block_size,
            head_dim=cfg.head_dim,
            dtype=dtype,
        )
        self.kv_cache = spec.allocate(device)
        self.num_blocks = num_blocks
        self._next_block = 0
        self.seqs: dict[int, _Seq] = {}

    def add_sequence(self, seq_id: int) -> None:
        self.seqs[seq_id] = _Seq()

    def _slot(self, seq: _Seq, pos: int) -> int:
        while pos // self.block_size >= len(seq.blocks):
            if self._next_block >= self.num_blocks:
                raise RuntimeError("PagedRunner: out of KV blocks")
            seq.blocks.append(self._next_block)
            self._next_block += 1
        return seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one forward pass; returns each sequence's logits ``[n_new, vocab]``."""
        starts, tables = [], []
        for seq_id, toks in new_tokens.items():
            seq = self.seqs[seq_id]
            starts.append(len(seq.tokens))
            for j in range(len(toks)):
                self._slot(seq, len(seq.tokens) + j)  # allocate blocks as needed
            seq.tokens.extend(toks)
            tables.append(list(seq.blocks))
        packed = pack_step(list(new_tokens.values()), starts, tables, self.block_size)
        step = packed.to_device(torch.device(self.device))
        hidden = self.model(step.input_ids, step.positions, step.attn, self.kv_cache)  # [T, H]
        logits = self.model.compute_logits(hidden)  # [T, vocab]
        return {
            seq_id: logits[s : s + len(toks)]
            for (seq_id, toks), s in zip(new_tokens.items(), packed.query_start, strict=True)
        }

    def prefill(self, seq_id: int, prompt: list[int], chunk: int | None = None) -> torch.Tensor:
        """Feed ``prompt`` (in chunks of ``chunk`` tokens if given); logits ``[len, vocab]``."""
        if seq_id not in self.seqs:
            self.add_sequence(seq_id)
        size = chunk or len(prompt)
        parts = [
            self.step({seq_id: prompt[i : i + size]})[seq_id] for i in range(0, len(prompt), size)
        ]
        return torch.cat(parts)

    def greedy(
        self, seq_id: int, prompt: list[int], max_new_tokens: int, chunk: int | None = None
    ) -> tuple[list[int], torch.Tensor]:
        """Prefill then decode one token per step; returns tokens and their logits rows."""
        last = self.prefill(seq_id, prompt, chunk)[-1:]
        out: list[int] = []
        rows = []
        for i in range(max_new_tokens):
            rows.append(last[0])
            tok = int(last[0].argmax())
            out.append(tok)
            if i + 1 < max_new_tokens:
                last = self.step({seq_id: [tok]})[seq_id]
        return out, torch.stack(rows)


def tp_greedy_worker(
    rank: int,
    world_size: int,
    init_method: str,
    jobs: list[tuple[str, list[list[int]], int]],
    result_queue: object,
) -> None:
    """Entry point of one TP rank in tests (a spawned process).

    For each job ``(model, prompts, max_new_tokens)`` greedy-decodes every prompt with this
    rank's shard and KV cache, then puts ``(rank, results)`` on ``result_queue`` where
    ``results[job] = (tokens_per_prompt, logits_per_prompt)``; on error ``(rank, traceback)``.
    """
    import traceback

    import torch.distributed as dist

    from engine.model.loader import load_model
    from engine.model.parallel import init_tp

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        init_tp(rank, world_size)
        results = []
        for model, prompts, max_new_tokens in jobs:
            net, cfg = load_model(model, tp_rank=rank, tp_size=world_size)
            runner = PagedRunner(net, cfg, num_blocks=64, block_size=16, tp_size=world_size)
            tokens, logits = [], []
            for i, prompt in enumerate(prompts):
                toks, rows = runner.greedy(i, prompt, max_new_tokens)
                tokens.append(toks)
                logits.append(rows.numpy())  # numpy: pickled by value, no shared memory
            results.append((tokens, logits))
        result_queue.put((rank, results))  # type: ignore[attr-defined]
    except BaseException:
        result_queue.put((rank, traceback.format_exc()))  # type: ignore[attr-defined]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
