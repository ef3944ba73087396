"""What the engine hands back to its callers, one object per request per step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from kvconnector.params import KVTransferParams

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log probabilities at one position, computed from the logits the token was sampled
    from (``log_softmax`` of the model's logits: before temperature, top-k/top-p and
    ``min_tokens`` masking, vLLM's default ``raw_logprobs``): the token's own, and the
    ``len(top_ids)`` most likely tokens, most likely first."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    # The token's place among all by log probability (1: the most likely; ties share the
    # better place), vLLM's ``rank``; None where not computed.
    rank: int | None = None


# One entry per token; None where this engine did not compute it: the first prompt token
# (nothing predicts it), or -- on a P/D decode node -- what the prefill node computed (the
# prompt, and the first token, which arrived with the KV).
Logprobs = list[TokenLogprob | None]


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Set with ``error`` when the HTTP answer is not a 500: ``KV_NOT_RESERVED`` (kvconnector.base).
    error_code: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Set on the prefill side when the request finished with KV held for a decode node.
    kv_transfer_params: KVTransferParams | None = None
    # With ``SamplingParams.logprobs``: one entry per new token (else None).
    new_logprobs: Logprobs | None = None
    # With ``SamplingParams.prompt_logprobs``: one entry per prompt token, in the first
    # output that carries tokens (else None).
    prompt_logprobs: Logprobs | None = None
    # Finished "stop" by its structured output's grammar (``GrammarState.finished``): it
    # took EOS where the stop check did not end the answer (``min_tokens``, ``ignore_eos``),
    # or it is complete and the request cannot take EOS (its last token is text).
    ended_by_grammar: bool = False
    # Prompt tokens the prefix cache held when the request started (``Request.
    # num_cached_tokens``); None while it waits.
    num_cached_tokens: int | None = None

    def copy(self) -> RequestOutput:
        """A copy whose lists a later ``merge`` may extend."""
        return dataclasses.replace(
            self,
            new_token_ids=list(self.new_token_ids),
            new_logprobs=None if self.new_logprobs is None else list(self.new_logprobs),
        )

    def merge(self, later: RequestOutput) -> None:
        """Fold a later output of the same request into this one (tokens appended, the
        latest state kept): what a reader that fell behind gets as one output."""
        self.new_token_ids.extend(later.new_token_ids)
        if later.new_logprobs is not None:
            if self.new_logprobs is None:
                self.new_logprobs = []
            self.new_logprobs.extend(later.new_logprobs)
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.finished, self.finish_reason, self.error, self.error_code = (
            later.finished, later.finish_reason, later.error, later.error_code,
        )  # fmt: skip
        self.num_prompt_tokens = later.num_prompt_tokens
        self.num_output_tokens = later.num_output_tokens
        self.kv_transfer_params = later.kv_transfer_params or self.kv_transfer_params
        self.ended_by_grammar = later.ended_by_grammar
        if later.num_cached_tokens is not None:
            self.num_cached_tokens = later.num_cached_tokens
