"""Sampling parameters of one request (validated; errors name the field)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.structured.reasoning import ReasoningTags
    from engine.structured.spec import StructuredOutput

GREEDY_TEMPERATURE_EPS = 1e-5
# Most alternatives a request may ask log probabilities of per token: --max-logprobs's
# default (vLLM's); the engine's scheduler and a node's HTTP layer enforce the flag.
MAX_LOGPROBS = 20
# The ranges of the penalties (OpenAI's for presence and frequency; vLLM takes any
# positive repetition penalty, but a logit divided by less than 1e-6 may overflow to inf).
PENALTY_RANGE = (-2.0, 2.0)
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
# Most ids in a request's ``allowed_token_ids`` (vLLM sets no bound). The list rides in the
# step message that brings the request to the workers (5 bytes an id pickled at most: 80 KB,
# under a millisecond of that step's host work for every request in it) and the sampler
# turns it into one [vocab] mask row per request, kept on the device, so no step pays for
# its length after the first. 16,384 ids is a ninth of a 150k vocabulary, room for label
# sets, digits, a language's tokens; a request refusing a few ids has logit_bias's -100.
MAX_ALLOWED_TOKEN_IDS = 16_384
# The largest temperature: float32's largest value. The sampler divides float32 logits by
# it; past this it is infinite there, and a masked logit (-inf / inf) becomes NaN, so the
# draw ignored ``allowed_token_ids`` and ``min_tokens`` (it picked token 0).
MAX_TEMPERATURE = 3.4028234663852886e38


class InvalidRequestError(ValueError):
    """A request parameter is invalid. ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_max_tokens(value: object, name: str = "max_tokens") -> int:
    """The one check of a completion budget's shape: an integer of at least 1.

    (Whether it fits the context or the KV cache is the scheduler's and the HTTP layer's
    ``resolve_max_tokens``'s business, which know the engine.)
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"'{name}' must be an integer, got {value!r:.40}", name)
    if value <= 0:
        raise InvalidRequestError(f"'{name}' must be at least 1, got {value}", name)
    return value


@dataclass
class SamplingParams:
    # None: up to the context (``max_model_len`` less the prompt; vLLM's), set at admission.
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = -1  # -1: disabled
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # No EOS or stop token id before this many output tokens (vLLM's extension). Not
    # checked against max_tokens here: a prefill node samples only the first token of a
    # request that asks for more.
    min_tokens: int = 0
    # Log probabilities of each output token and of this many top alternatives (None: none).
    logprobs: int | None = None
    # The same for each prompt token (the first has none): echo with logprobs.
    prompt_logprobs: int | None = None
    # Added to the logits before anything else (OpenAI's ``logit_bias``: token id -> bias;
    # the HTTP layer checks the ids against the vocabulary and clamps to [-100, 100]).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's ``min_p``: after the temperature, tokens less likely than ``min_p`` times the
    # most likely one are not drawn (0: off).
    min_p: float = 0.0
    # OpenAI's penalties on the output so far (each in [-2, 2]): ``presence`` once per token
    # that occurred, ``frequency`` per occurrence; vLLM's ``repetition`` (> 0; 1: off)
    # divides a positive logit (multiplies a negative one) of every token in the prompt or
    # the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # vLLM's ``allowed_token_ids``: only these ids may be sampled (None: every id; never
    # empty). The HTTP layer checks the ids against the vocabulary; the sampler ignores
    # ids past it.
    allowed_token_ids: list[int] | None = None
    # A structured output (``engine/structured``): the output follows this grammar. The
    # engine process keeps the matcher; the workers get each step's bitmask.
    structured_output: StructuredOutput | None = None
    # The answer reasons first (a chat answer on a node with ``--reasoning-parser``): the
    # structured output constrains only what follows the reasoning's end (the parser's
    # tags as token ids, ``engine/structured/reasoning.py``; None: no reasoning part).
    reasoning_tags: ReasoningTags | None = None
    # vLLM's ``bad_words``, as token id sequences (``engine.bad_words``): a sequence's last
    # id is not sampled where the output ends with the rest of it.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Text-level fields (vLLM's), read by the offline ``LLM`` (``engine/llm.py``) and not by
    # the engine: ``n`` answers per prompt (answer ``j`` seeded ``seed + j``, as a node's);
    # ``stop`` strings (one string or a list) end the answer, left out of its text unless
    # ``include_stop_str_in_output``; ``skip_special_tokens`` in the text. A node takes
    # these from the request's fields (``server/jobs.py``), and sets ``stop`` too: the
    # engine only counts a request with stop strings that ended by itself once its caller
    # said whether one ended it (``RequestMetrics.finished``).
    n: int = 1
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            check_max_tokens(self.max_tokens)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if not isinstance(self.stop, list | tuple) or not all(
            isinstance(s, str) for s in self.stop
        ):
            raise InvalidRequestError("stop must be a string or a list of strings", "stop")
        if any(not s for s in self.stop):  # vLLM's check: "" would match everywhere
            raise InvalidRequestError("stop cannot contain an empty string", "stop")
        self.stop = list(self.stop)
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise InvalidRequestError("n must be an integer of at least 1", "n")
        if self.min_tokens < 0:
            raise InvalidRequestError("min_tokens must be >= 0", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and k < 0:
                raise InvalidRequestError(f"{name} must be >= 0", name)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}]", "temperature"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequestError("top_k must be -1 (disabled) or >= 1", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be in [0, 1]", "min_p")
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            if not lo <= getattr(self, name) <= hi:
                raise InvalidRequestError(f"{name} must be in [{lo:g}, {hi:g}]", name)
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise InvalidRequestError(
                f"repetition_penalty must be in [{lo:g}, {hi:g}]", "repetition_penalty"
            )
        if not all(t >= 0 and math.isfinite(b) for t, b in self.logit_bias.items()):
            raise InvalidRequestError(
                "logit_bias must map non-negative token ids to finite numbers", "logit_bias"
            )
        if not all(seq and all(t >= 0 for t in seq) for seq in self.bad_words_token_ids):
            raise InvalidRequestError(
                "bad_words_token_ids must be non-empty sequences of non-negative token ids",
                "bad_words",
            )
        allowed = self.allowed_token_ids
        if allowed is not None and not (
            0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS
            and all(isinstance(t, int) and t >= 0 for t in allowed)
        ):
            raise InvalidRequestError(
                f"allowed_token_ids must be None or 1 to {MAX_ALLOWED_TOKEN_IDS} non-negative "
                "token ids",
                "allowed_token_ids",
            )

    def banned_token_ids(self, eos_token_ids: Iterable[int]) -> tuple[int, ...]:
        """The ids that may not be sampled while ``min_tokens`` is not reached: the stop
        token ids, and EOS unless ``ignore_eos``."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return tuple(sorted(ids))

    @property
    def bans_after_tokens(self) -> bool:
        """A sample's ban depends on the output's last tokens (a bad word of 2+ ids)."""
        return any(len(seq) > 1 for seq in self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        """The sample depends on the tokens so far (the workers keep them for it)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        # A temperature too small to divide logits by is greedy (vLLM's epsilon).
        return self.temperature < GREEDY_TEMPERATURE_EPS
