"""The client's ``usage.prompt_tokens_details.cached_tokens`` of a P/D answer.

The answer is D's, but D computed no prompt token: its KV came from P, which computed
what its prefix cache did not hold. So the prompt tokens that came from a prefix cache are
P's hit -- what a colocated node with P's cache would report -- and the proxy writes P's
count (``kv_transfer_params.num_cached_tokens`` of P's answer) over D's own (D's prefix
cache hits only shortened the push; P computed those tokens anyway). Only where D has
``--enable-prompt-tokens-details`` (``Node.prompt_tokens_details``, from its
``/v1/kv_transfer_info``): the field's presence is D's flag. As vLLM, 0 is no field.
P's count is untrusted: one that is not a non-negative integer no larger than the
prompt is ignored with a warning (D's usage stays as D wrote it).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def prefill_cached_tokens(p_body: Any, prompt_tokens: Any, request_id: str) -> int | None:
    """P's cached count from its answer ``p_body``, checked against the prompt's
    ``prompt_tokens``; None when P's answer has none (or it is not a count)."""
    kv = p_body.get("kv_transfer_params") if isinstance(p_body, dict) else None
    value = kv.get("num_cached_tokens") if isinstance(kv, dict) else None
    if value is None:
        return None
    is_int = isinstance(value, int) and not isinstance(value, bool)
    prompt_ok = isinstance(prompt_tokens, int) and not isinstance(prompt_tokens, bool)
    if not (is_int and value >= 0 and prompt_ok and value <= prompt_tokens):
        logger.warning(
            "request %s: the prefill node's num_cached_tokens %.40r is not a count of "
            "the prompt's %.20r tokens: ignored", request_id, value, prompt_tokens,
        )  # fmt: skip
        return None
    return value


def set_cached_tokens(usage: dict[str, Any], cached: int) -> None:
    """``usage`` with ``cached`` prompt tokens from a prefix cache (none: no field)."""
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    else:
        usage.pop("prompt_tokens_details", None)
