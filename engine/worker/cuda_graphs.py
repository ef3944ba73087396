"""CUDA graphs of decode steps, one per batch-size bucket.

A decode step (every sequence computes one token) is captured once per bucket of batch
sizes with static inputs: one packed int64 buffer per bucket (the layout of
``engine.model.attention.PackedStep``; its unpacking is part of the graph) and a static
hidden-state output. A step of ``n`` sequences replays the smallest bucket ``b >= n``
after copying its packed inputs, padded with ``b - n`` padding sequences (no KV slot,
context length 0), into that bucket's buffer. Prefill and mixed steps run eagerly.

With ``capture=False`` the same padded static-buffer path runs eagerly: that is how the
padding is tested on CPU, where graphs do not exist.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.model.attention import PackedStep, pack_step
from engine.worker.staging import HostStaging

logger = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (vLLM's)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        block_size: int,
        width: int,
        max_num_seqs: int,
        device: torch.device,
        capture: bool = True,
        staging: HostStaging | None = None,
    ) -> None:
        if model.attn_backend.name == "reference":
            raise ValueError("decode graphs need a graph-safe attention backend, not reference")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.width = width  # block-table columns: the most blocks one sequence can have
        self.buckets = decode_buckets(max_num_seqs)
        self.device = device
        self.use_graphs = capture
        self.staging = staging or HostStaging(device)  # the runner's, shared
        self._bufs: dict[int, torch.Tensor] = {}  # bucket -> static packed inputs
        self._layouts: dict[int, PackedStep] = {}
        self._outs: dict[int, torch.Tensor] = {}  # bucket -> static hidden [b, H]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        for b in self.buckets:
            layout = pack_step([], [], [], block_size, width=width, pad_seqs=b)
            self._layouts[b] = layout
            self._bufs[b] = layout.buffer.to(device)

    def can_run(self, token_ids: list[list[int]]) -> bool:
        return 0 < len(token_ids) <= self.buckets[-1] and all(len(t) == 1 for t in token_ids)

    def bucket_for(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def _forward(self, b: int) -> torch.Tensor:
        step = self._layouts[b].unpack(self._bufs[b])
        return self.model(step.input_ids, step.positions, step.attn, self.kv_cache)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (padding only: the
        captured runs write no KV slot)."""
        if not self.use_graphs:
            return
        start = time.monotonic()
        pool = None
        for b in reversed(self.buckets):
            self._forward(b)  # warm-up: kernel compilation happens outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outs[b] = self._forward(b)
            pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs (batch %d..%d) in %.1f s",
            len(self.buckets),
            self.buckets[0],
            self.buckets[-1],
            time.monotonic() - start,
        )

    def run(
        self,
        token_ids: list[list[int]],
        starts: list[int],
        tables: Sequence[Sequence[int] | np.ndarray],
        fill: Callable[[torch.Tensor, PackedStep], None] | None = None,
    ) -> tuple[PackedStep, torch.Tensor]:
        """One decode step of ``len(token_ids)`` sequences; returns its packing and the hidden
        states ``[b, H]`` (rows past the real sequences are padding). ``fill(buffer,
        packed)`` may change the static input buffer on the device before the replay
        (async scheduling: the placeholders)."""
        n = len(token_ids)
        b = self.bucket_for(n)
        packed = pack_step(
            token_ids, starts, tables, self.block_size, width=self.width, pad_seqs=b - n
        )
        self.staging.to_device(packed.buffer, out=self._bufs[b])
        if fill is not None:
            fill(self._bufs[b], packed)
        if b in self._graphs:
            self._graphs[b].replay()
            return packed, self._outs[b]
        return packed, self._forward(b)
