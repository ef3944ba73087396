"""What the scheduler sends to every worker each step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.stats import Stats

# Async scheduling: stands for the token the step in flight samples for the request (the
# workers put in what they sampled); never a real token id.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class ScheduledSeq:
    """One request's slice of this step: tokens at positions ``start_pos ..``."""

    request_id: str
    # The tokens to compute this step; with async scheduling the last may be
    # PLACEHOLDER_TOKEN_ID (a 1-token decode of what the previous step sampled).
    token_ids: list[int]
    start_pos: int  # request.num_computed_tokens when scheduled
    # The request's block table, sent as a change (``engine/worker/request_states.py``):
    # these ids are appended to the table the workers hold for it, or make a new one when
    # ``new_table`` (the request's first step, or its first since its blocks were freed and
    # allocated again: preemption). ``num_blocks``: the table's length after this step.
    new_block_ids: list[int]
    # The request's parameters: sent with a new table only (the workers keep them).
    sampling_params: SamplingParams | None = None
    # While ``min_tokens`` is not reached: the ids the sample may not be (EOS, stop ids).
    banned_token_ids: tuple[int, ...] = ()
    # bad_words' ban for this sample (``engine.bad_words``): unlike min_tokens', it holds
    # where it leaves no allowed id.
    bad_token_ids: tuple[int, ...] = ()
    # Prompt logprobs (echo with logprobs): the rows from ``prompt_row`` on predict these
    # prompt tokens (``prompt_targets[j]`` is the token after row ``prompt_row + j``);
    # ``prompt_logprobs`` alternatives each.
    prompt_targets: list[int] = field(default_factory=list)
    prompt_row: int = 0
    prompt_logprobs: int = 0
    # Penalties (``SamplingParams.has_penalties``): the request's tokens the workers were
    # not sent yet (all of them with a new table: prompt first), and how many of all of
    # them are the prompt's. Placeholders are not among them (the workers add those).
    penalty_token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    num_blocks: int = -1  # -1: len(new_block_ids) (a new table)
    new_table: bool = True
    # This step computes the request's last known token: sample the next one.
    samples: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    step_id: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # Requests that finished since the last step (workers drop per-request state).
    finished_request_ids: set[str] = field(default_factory=set)
    # Requests preempted since the last step: workers drop their state too (a resumed
    # request comes back with a new table); unlike finished ones, not the connector's.
    preempted_request_ids: set[str] = field(default_factory=set)
    # Per-step connector metadata (kvconnector.base.KVConnectorMetadata); bound by each
    # worker before the forward pass and cleared at the end of the step.
    kv_connector_metadata: Any = None
    # Structured outputs: the grammar bitmasks of this step's sampling rows that have one,
    # and those rows, in one int32 buffer (``engine/structured/matcher.py:fill_bitmask``;
    # rank 0's sampler applies it). None when no row samples under a grammar.
    grammar_bitmask: Any = None
    # Async scheduling: a row samples after a token still in flight, and its grammar mask
    # or bad words' ban follows that token: the workers run the forward, then wait for a
    # ``DeferredSampling`` (sent once the step before was updated) before they sample
    # (vLLM's ``sample_tokens``).
    sampling_deferred: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@dataclass(frozen=True)
class DeferredSampling:
    """What a step sent with ``sampling_deferred`` samples with, made after the step
    before was updated, for the worker that samples (rank 0): the grammar masks (as
    ``SchedulerOutput.grammar_bitmask``; None: no row has one now) and the bad words' ids
    of the rows whose ban follows the output's last tokens (sampling row -> ids; they
    replace those rows' ``ScheduledSeq.bad_token_ids``). ``failed``: none will come (the
    step before failed, so the tokens they follow are not known), and why: the step fails
    with it instead of sampling."""

    step_id: int
    bitmask: Any = None
    bad_token_ids: dict[int, tuple[int, ...]] = field(default_factory=dict)
    failed: str | None = None


@dataclass
class WorkerOutput:
    """One TP rank's result for one step (un-aggregated: never given to the scheduler)."""

    rank: int
    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # rank 0 only
    # Requests that asked for logprobs (rank 0 only): the sampled token's, and the prompt's.
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    finished_sending: set[str] = field(default_factory=set)  # P request ids
    # The connector's transfer keys whose KV this rank has (NIXL: reservation nonces).
    finished_recving: set[str] = field(default_factory=set)
    # Per transfer key: data that arrived with the KV (its request id, the first token).
    kv_recv_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per-request transfer failures seen by this rank: request id -> reason.
    kv_failed: dict[str, str] = field(default_factory=dict)
    kv_stats: Stats | None = None  # the connector's per-rank counters (typed)
    # From receiving the step (and the step before's output gone) to this output ready
    # (step_stats.py).
    busy_s: float = 0.0
    # Async scheduling (rank 0): the sampled ids still on their way from the device, as
    # (request ids, staging.PendingIds); the worker puts them into ``sampled_token_ids``
    # (``resolve_sampled``) before the output leaves the process. Never pickled.
    pending_sampled: Any = None

    def resolve_sampled(self) -> WorkerOutput:
        if self.pending_sampled is not None:
            rids, pending = self.pending_sampled
            self.sampled_token_ids = dict(zip(rids, pending.result(), strict=True))
            self.pending_sampled = None
        return self


@dataclass
class ModelRunnerOutput:
    """The aggregated result of a step across all TP ranks: what the scheduler sees."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    kv_recv_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    kv_failed: dict[str, str] = field(default_factory=dict)
    kv_stats: Stats | None = None  # the connector's per-rank counters (typed)
    worker_busy_s: float = 0.0  # the slowest rank's busy_s
    # ``time.perf_counter()`` when the ranks' outputs were aggregated: when the step's
    # result was there (async scheduling's step split: the engine waits for it later).
    done_at: float = 0.0
