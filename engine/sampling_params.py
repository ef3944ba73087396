"""Sampling parameters of one request (validated; errors name the field)."""

from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_TEMPERATURE_EPS = 1e-5


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
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1: disabled
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_max_tokens(self.max_tokens)
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0", "temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequestError("top_k must be -1 (disabled) or >= 1", "top_k")

    @property
    def greedy(self) -> bool:
        # A temperature too small to divide logits by is greedy (vLLM's epsilon).
        return self.temperature < GREEDY_TEMPERATURE_EPS
