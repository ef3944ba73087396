"""Runs the model on one TP rank: packs the step's batch, forwards, samples.

Life of a runner: load the model (``__init__``), ``profile_kv_bytes()`` (CUDA: how much
memory the KV cache may take), ``init_kv_cache(num_blocks)`` (allocate, then capture the
decode CUDA graphs), then ``execute(sched)`` every step.

A step's inputs are packed on the host into one buffer and copied in one transfer; nothing
in the forward reads a device value back; the only host read is the sampled token ids
(and, for requests that asked for them, their log probabilities).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core.kv_cache_manager import cdiv
from engine.core.scheduler_output import (
    PLACEHOLDER_TOKEN_ID,
    ScheduledSeq,
    SchedulerOutput,
    WorkerOutput,
)
from engine.kv_cache_layout import KVCacheSpec, torch_dtype
from engine.model.attention import pack_step
from engine.model.attention.metadata import PackedStep
from engine.model.loader import load_model
from engine.model.parallel import tp_broadcast_
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.gpu_memory import kv_cache_budget
from engine.worker.penalties import PenaltyHistory
from engine.worker.request_states import RequestStates
from engine.worker.sampler import Sampler, compute_logprobs
from engine.worker.staging import HostStaging, Readback

logger = logging.getLogger(__name__)

# Prompt rows whose logits are computed at once for prompt logprobs.
PROMPT_LOGPROBS_ROWS = 256


# Async scheduling: "1" makes rank 0 hand back a step's sampled ids after the next step's
# launch (the worker holds the output meanwhile) also off CUDA (tests), "0" never; unset:
# on CUDA. On a CPU the "launch" is the whole forward, so holding only adds latency.
DEFER_READBACK_ENV = "PDSERVE_DEFER_READBACK"


def placeholder_sources(
    seqs: list[ScheduledSeq], prev_rows: dict[str, int]
) -> tuple[list[int], list[int]]:
    """Async scheduling: the sequences whose last token is a placeholder (a decode of what
    the previous sampling step sampled for them), and for each the row of that sample
    (``prev_rows``: request id -> row, of the previous sampling step)."""
    seq_idx: list[int] = []
    src: list[int] = []
    for i, s in enumerate(seqs):
        ids = s.token_ids
        if ids and ids[-1] == PLACEHOLDER_TOKEN_ID:
            row = prev_rows.get(s.request_id)
            if row is None:  # the scheduler's invariant, broken
                raise RuntimeError(
                    f"request {s.request_id!r}: a placeholder token but no sample from the "
                    "previous step"
                )
            seq_idx.append(i)
            src.append(row)
    return seq_idx, src


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int, world_size: int, device: str) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        # Free device memory before the weights: what this process takes later is measured
        # from here, so other processes' memory is not counted as this node's.
        self._free_at_start = (
            torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        )
        # A runner in its engine's process (``uni``) may start where torch holds memory.
        self._torch_at_start = (
            (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
            if self.device.type == "cuda"
            else (0, 0)
        )
        self.dtype = torch_dtype(config.model.dtype)  # resolved by the engine (never "auto")
        self.model, self.arch = load_model(
            config.model.model,
            rank,
            world_size,
            self.dtype,
            self.device,
            config.model.seed,
            attention_backend=config.model.attention_backend,
        )
        self.block_size = config.cache.block_size
        max_model_len = config.model.max_model_len or self.arch.max_position_embeddings
        self.max_blocks_per_seq = cdiv(max_model_len, self.block_size)
        self.kv_spec: KVCacheSpec | None = None
        self.kv_cache: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        self.staging = HostStaging(self.device)
        self.sampler = Sampler(self.device, config.scheduler.max_num_seqs)
        self.requests = RequestStates()  # per request: block table, sampling parameters
        # Async scheduling: the last sampling step's ids [S] on the device, on every rank
        # (rank 0's, broadcast), and each request's row: a step's placeholders are filled
        # from them on the device, so no rank waits for the host to learn them.
        self.async_scheduling = config.scheduler.async_scheduling
        self._prev_ids: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        # One staging per use, two slots each: a copy never waits for the step in flight.
        self._fill_staging = HostStaging(self.device, slots=2)
        self._rows_staging = HostStaging(self.device, slots=2)
        self._readback = Readback(self.device)
        flag = os.environ.get(DEFER_READBACK_ENV)
        self.defer_readback = self.async_scheduling and (
            flag == "1" if flag in ("0", "1") else self.device.type == "cuda"
        )

    def _spec(self, num_blocks: int) -> KVCacheSpec:
        return KVCacheSpec.for_model(self.arch, self.config, num_blocks)

    # -- start-up ---------------------------------------------------------------------------
    @torch.inference_mode()
    def profile_kv_bytes(self) -> int | None:
        """CUDA: bytes the KV cache may take on this rank, ``--gpu-memory-utilization`` of the
        device less the weights and the peak of a dummy forward at the largest step. None on
        CPU (the engine sizes the cache from host memory)."""
        if self.device.type != "cuda":
            return None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        sched = self.config.scheduler
        tokens = sched.max_num_batched_tokens
        # A dummy step at the token budget, as one prefill over a small scratch cache.
        spec = self._spec(cdiv(tokens, self.block_size) + 1)
        scratch = spec.allocate(self.device)
        blocks = list(range(1, spec.num_blocks))
        packed = pack_step([[0] * tokens], [0], [blocks], self.block_size)
        step = packed.to_device(self.device)
        hidden = self.model(step.input_ids, step.positions, step.attn, scratch)
        rows = min(sched.max_num_seqs, tokens)
        # The sampler's [S, V] temporaries at their largest (a bias copy, penalties, min-p,
        # the sort, the allowed_token_ids masks) and the penalties' pool, made whole at
        # max_num_seqs rows as the serving sampler's will be: each row its own request, on
        # a sampler and histories of its own that take them along when they go.
        worst = SamplingParams(
            temperature=1.0, top_k=50, top_p=0.9, seed=0, min_p=0.01, logit_bias={0: 1.0},
            repetition_penalty=1.1, frequency_penalty=0.1, allowed_token_ids=[0],
        )  # fmt: skip
        Sampler(self.device, sched.max_num_seqs).sample(
            self.model.compute_logits(hidden[:rows]),
            [dataclasses.replace(worst) for _ in range(rows)],
            list(range(rows)),
            penalties=[PenaltyHistory(0) for _ in range(rows)],
        )
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - spec.block_bytes * spec.num_blocks
        del scratch, hidden, step
        torch.cuda.empty_cache()
        free_now, total = torch.cuda.mem_get_info(self.device)
        b = kv_cache_budget(
            total=total,
            utilization=self.config.cache.gpu_memory_utilization,
            free_at_start=self._free_at_start,
            free_now=free_now,
            reserved_now=torch.cuda.memory_reserved(self.device),
            weights=weights,
            peak=peak,
            allocated_at_start=self._torch_at_start[0],
            reserved_at_start=self._torch_at_start[1],
        )
        gib = 2**30
        logger.info(
            "rank %d memory: total %.2f GiB, budget %.2f GiB (%.0f%%), weights %.2f GiB, "
            "activation peak %.2f GiB, non-torch %.2f GiB, free %.2f GiB -> KV cache %.2f GiB",
            self.rank,
            b.total / gib,
            b.budget / gib,
            100 * self.config.cache.gpu_memory_utilization,
            b.weights / gib,
            b.activations / gib,
            b.non_torch / gib,
            b.free / gib,
            b.kv_bytes / gib,
        )
        if b.limited_by_free:
            logger.warning(
                "rank %d: other processes hold GPU memory; the KV cache gets %.2f GiB, less "
                "than this node's share of %.0f%% would give (free the GPU or lower "
                "--gpu-memory-utilization of the other nodes on it)",
                self.rank,
                b.kv_bytes / gib,
                100 * self.config.cache.gpu_memory_utilization,
            )
        return b.kv_bytes

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``[num_blocks, layers, 2, kv_heads, block_size, head_dim]``; capture the
        decode graphs on CUDA unless ``--enforce-eager``."""
        self.kv_spec = self._spec(num_blocks)
        self.kv_cache = self.kv_spec.allocate(self.device)
        use_graphs = (
            self.device.type == "cuda"
            and not self.config.model.enforce_eager
            and self.model.attn_backend.name != "reference"
        )
        if use_graphs:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_cache,
                self.block_size,
                self.max_blocks_per_seq,
                self.config.scheduler.max_num_seqs,
                self.device,
                staging=self.staging,
            )
            self.graphs.capture()

    # -- steps ------------------------------------------------------------------------------
    def update_states(self, sched: SchedulerOutput) -> None:
        """Every step, before anything else (tokens or not): the requests' changes (block
        tables, new and finished requests)."""
        self.requests.update(sched)

    @torch.inference_mode()
    def execute(
        self,
        sched: SchedulerOutput,
        after_layer: Callable[[int], None] | None = None,
        deferred_source: Callable[[int], Any] | None = None,
    ) -> WorkerOutput:
        """Forward the step's tokens; returns the sampled tokens and the log probabilities
        asked for (rank 0 only; other ranks return an empty output). A step sent with
        ``sampling_deferred`` asks ``deferred_source(step_id)`` for its grammar masks and
        bad words' bans (a ``DeferredSampling``) after the forward was launched, right
        before sampling (rank 0 only)."""
        assert self.kv_cache is not None, "init_kv_cache() first"
        seqs = sched.seqs
        fill = None
        if self.async_scheduling:
            seq_idx, src = placeholder_sources(seqs, self._prev_rows)
            if seq_idx:
                fill = functools.partial(self._fill_placeholders, seq_idx=seq_idx, src=src)

        token_ids = [s.token_ids for s in seqs]
        starts = [s.start_pos for s in seqs]
        tables = [self.requests.block_ids(s.request_id) for s in seqs]
        graphs = self.graphs
        if graphs is not None and after_layer is None and graphs.can_run(token_ids):
            packed, hidden = graphs.run(token_ids, starts, tables, fill=fill)
        else:
            packed = pack_step(token_ids, starts, tables, self.block_size)
            dev = self.staging.to_device(packed.buffer)
            if fill is not None:
                fill(dev, packed)
            step = packed.unpack(dev)
            hidden = self.model(
                step.input_ids, step.positions, step.attn, self.kv_cache, after_layer
            )
        # hidden: [T, H]; sample from each sampling sequence's last row.
        rows = [
            packed.query_start[i] + packed.query_lens[i] - 1
            for i, seq in enumerate(seqs)
            if seq.samples
        ]
        out = WorkerOutput(rank=self.rank)
        prompt_rows = [
            (seq, packed.query_start[i] + seq.prompt_row)
            for i, seq in enumerate(seqs)
            if seq.prompt_targets
        ]
        if prompt_rows:  # echo with logprobs: every rank computes the same logits
            out.prompt_logprobs = self._prompt_logprobs(hidden, prompt_rows)
        if not rows:
            return out
        if rows[-1] == len(rows) - 1:  # rows 0..S-1 (decodes): a view, no index copy
            picked = hidden[: len(rows)]
        else:  # through pinned staging: no wait for the forward before the copy
            idx = self._rows_staging.to_device(torch.tensor(rows, dtype=torch.long))
            picked = hidden[idx]
        logits = self.model.compute_logits(picked)  # [S, vocab] float32, all ranks
        sampled = [s for s in seqs if s.samples]
        if self.rank != 0:
            if self.async_scheduling:  # the next step's placeholders: rank 0's samples
                ids = torch.empty(len(sampled), dtype=torch.int64, device=self.device)
                self._keep_samples(sampled, tp_broadcast_(ids))
            return out
        try:
            params = [self.requests.sampling_params(s.request_id) for s in sampled]
            bitmask, bad = sched.grammar_bitmask, [s.bad_token_ids for s in sampled]
            if sched.sampling_deferred:  # masks and bans that follow the token in flight
                assert deferred_source is not None, "a deferred sampling step needs its source"
                deferred = deferred_source(sched.step_id)
                bitmask = deferred.bitmask
                bad = [deferred.bad_token_ids.get(i, b) for i, b in enumerate(bad)]
            args = (
                logits,
                params,
                [s.start_pos + s.num_tokens for s in sampled],
                [s.banned_token_ids for s in sampled],
                *self._penalty_args(sampled, params),
                bitmask,
                bad,
            )
            want = [i for i, sp in enumerate(params) if sp.logprobs is not None]  # type: ignore[union-attr]
            if self.async_scheduling:
                ids = self.sampler.sample_on_device(*args)  # type: ignore[arg-type]
        except BaseException:
            if self.async_scheduling and self.world_size > 1:
                # The other ranks wait in the broadcast: free them (the step fails anyway).
                tp_broadcast_(torch.zeros(len(sampled), dtype=torch.int64, device=self.device))
            raise
        if self.async_scheduling:
            if self.world_size > 1:
                tp_broadcast_(ids)
            self._keep_samples(sampled, ids)
            if self.defer_readback and after_layer is None and not want:
                # The worker sends this output after it launched the next step.
                rids = [s.request_id for s in sampled]
                out.pending_sampled = (rids, self._readback.start(ids))
                return out
            tokens = ids.tolist()
        else:
            tokens = self.sampler.sample(*args)  # type: ignore[arg-type]
        out.sampled_token_ids = {s.request_id: t for s, t in zip(sampled, tokens, strict=True)}
        if want:  # only rows that asked: no cost for the others
            idx = torch.tensor(want, dtype=torch.long).to(self.device, non_blocking=True)
            lps = compute_logprobs(
                logits[idx],
                [tokens[i] for i in want],
                [params[i].logprobs for i in want],  # type: ignore[union-attr,misc]
            )
            out.logprobs = {sampled[i].request_id: lp for i, lp in zip(want, lps, strict=True)}
        return out

    def _penalty_args(
        self, sampled: list[ScheduledSeq], params: list[SamplingParams]
    ) -> tuple[
        list[PenaltyHistory | None] | None, tuple[list[int], list[int], torch.Tensor] | None
    ]:
        """The sampler's ``penalties`` and ``pending`` (the placeholders' samples, on the
        device: the previous step's, async scheduling) for this step's sampled rows."""
        if not any(sp.has_penalties for sp in params):
            return None, None
        histories = [
            self.requests.penalty(s.request_id) if sp.has_penalties else None
            for s, sp in zip(sampled, params, strict=True)
        ]
        if self._prev_ids is None:
            return histories, None
        seq_idx, src = placeholder_sources(sampled, self._prev_rows)
        picked = [(i, r) for i, r in zip(seq_idx, src, strict=True) if histories[i] is not None]
        if not picked:
            return histories, None
        rows, src = (list(x) for x in zip(*picked, strict=True))
        return histories, (rows, src, self._prev_ids)

    def _keep_samples(self, sampled: list[ScheduledSeq], ids: torch.Tensor) -> None:
        """Async scheduling: this step's samples fill the next step's placeholders."""
        self._prev_ids = ids
        self._prev_rows = {s.request_id: j for j, s in enumerate(sampled)}

    def _fill_placeholders(
        self, dev: torch.Tensor, packed: PackedStep, seq_idx: list[int], src: list[int]
    ) -> None:
        """Write the previous step's samples (rows ``src`` of ``_prev_ids``) over the
        placeholders of sequences ``seq_idx`` in ``dev``, the step's buffer on the device
        (its first entries are the input ids), before the forward reads it."""
        assert self._prev_ids is not None
        dst = [packed.query_start[i] + packed.query_lens[i] - 1 for i in seq_idx]
        idx = self._fill_staging.to_device(torch.tensor(dst + src, dtype=torch.int64))
        n = len(dst)
        dev.index_copy_(0, idx[:n], self._prev_ids.index_select(0, idx[n:]))

    def _prompt_logprobs(
        self, hidden: torch.Tensor, seqs: list[tuple[ScheduledSeq, int]]
    ) -> dict[str, list[TokenLogprob]]:
        """Each sequence's prompt targets' log probabilities, from the rows before them,
        ``PROMPT_LOGPROBS_ROWS`` rows at a time (a long prompt's [rows, vocab] logits would
        not fit at once). Every rank computes the logits (a TP collective); rank 0 keeps
        the result."""
        out: dict[str, list[TokenLogprob]] = {}
        for seq, first in seqs:
            entries: list[TokenLogprob] = []
            targets = seq.prompt_targets
            for lo in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
                hi = min(lo + PROMPT_LOGPROBS_ROWS, len(targets))
                logits = self.model.compute_logits(hidden[first + lo : first + hi])
                if self.rank == 0:
                    k = seq.prompt_logprobs
                    entries += compute_logprobs(logits, targets[lo:hi], [k] * (hi - lo))
            if self.rank == 0:
                out[seq.request_id] = entries
        return out
