"""The request data object: tokens, token accounting and state. No behaviour beyond that."""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from engine.outputs import FinishReason, Logprobs, TokenLogprob
from engine.sampling_params import SamplingParams
from kvconnector.params import KVTransferParams

if TYPE_CHECKING:
    from engine.structured.matcher import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request.

    Token accounting: ``all_token_ids`` is prompt + output; ``num_computed_tokens`` counts
    the tokens whose KV is in the cache or being written by a step already scheduled.
    Each step schedules ``num_tokens - num_computed_tokens`` (capped by the budget; plus
    ``num_output_placeholders`` with async scheduling); prefill, chunked prefill,
    remote KV (which advances ``num_computed_tokens`` without a forward pass) and decode
    are all this one rule.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Collection[int] = (),
        kv_transfer_params: KVTransferParams | None = None,
        label: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, KVTransferParams):
            raise TypeError(
                "kv_transfer_params must be a KVTransferParams (parse a dict with "
                f"KVTransferParams.from_dict), got {type(kv_transfer_params).__name__}"
            )
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise TypeError(
                f"cache_salt must be None or a non-empty string, got {cache_salt!r:.60}"
            )
        self.request_id = request_id
        # The client's name for it (``X-Request-Id``): logged, echoed, never a key.
        self.label = label or request_id
        # --scheduling-policy priority: lower starts first (then the earlier arrival).
        self.priority = priority
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_transfer_params = kv_transfer_params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Async scheduling: tokens sampled by steps in flight, not known yet.
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        # Penalties: how many of ``all_token_ids`` the workers were sent (0: a new table).
        self.penalty_tokens_sent = 0
        # vLLM's ``cache_salt``: mixed into the first full block's hash, so the whole chain
        # (``block_hashes``) is this salt's: other salts, or none, never hit its blocks.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []  # prefix-cache keys of its full blocks (block_hash.py)
        self.arrival_time = time.monotonic()
        # Request-level metrics (``scheduler_stats.RequestMetrics``), monotonic seconds.
        self.scheduled_time: float | None = None  # first admitted
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # Where the prompt's KV came from at its last admission (vLLM's prompt tokens by
        # source): prefix-cache hits here, and KV a prefill node pushed.
        self.num_cached_prompt_tokens = 0
        self.num_external_prompt_tokens = 0
        # vLLM's ``num_cached_tokens``: the prompt tokens this node's prefix cache held at
        # the first admission (None until then), so not those recomputed after a
        # preemption nor, on a decode node, the KV the prefill node pushed (the usage's
        # ``prompt_tokens_details.cached_tokens``; docs/api.md).
        self.num_cached_tokens: int | None = None
        self.error: str | None = None
        self.error_code: str | None = None  # machine-readable, for the HTTP answer
        # Log probabilities, when the sampling params ask for them: one entry per output
        # token, and per prompt token as they are computed (the first prompt token has
        # none; None also marks what a prefill node computed for a decode node).
        self.output_logprobs: Logprobs | None = [] if sampling_params.logprobs is not None else None
        self.prompt_logprobs: Logprobs | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )
        self.prompt_logprobs_sent = False
        # Output tokens not yet handed to the caller.
        self._num_emitted = 0
        # Structured output: the grammar's state after the output tokens so far
        # (``engine/structured/matcher.py``; set by the scheduler when it admits the request).
        self.grammar: GrammarState | None = None
        self.ended_by_grammar = False  # finished "stop" by its grammar (``GrammarState.finished``)

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set: each output token is looked up in it."""
        return frozenset(self.sampling_params.stop_token_ids)

    @functools.cached_property
    def banned_token_ids(self) -> tuple[int, ...]:
        """The ids masked while ``min_tokens`` is not reached, built once (not per step)."""
        return self.sampling_params.banned_token_ids(self.eos_token_ids)

    @property
    def transfer_id(self) -> str:
        """Pairs the two legs of a disaggregated request: the given id, else the request id."""
        params = self.kv_transfer_params
        return (params.transfer_id if params is not None else None) or self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are not computed yet."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < self.num_prompt_tokens

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.all_token_ids.append(token_id)
        if self.output_logprobs is not None:
            self.output_logprobs.append(logprob)

    def take_new_output_tokens(self) -> list[int]:
        # Sliced from the end: a step costs its new tokens, not the whole output so far.
        out = self.all_token_ids[len(self.prompt_token_ids) + self._num_emitted :]
        self._num_emitted += len(out)
        return out

    def take_new_outputs(self) -> tuple[list[int], Logprobs | None]:
        """The output tokens (and their logprobs, if asked for) not handed out yet."""
        start = self._num_emitted
        ids = self.take_new_output_tokens()
        lps = self.output_logprobs
        return ids, None if lps is None else lps[start : start + len(ids)]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
