"""One request field at a time: the parsers of the fields that need more than a typed
getter (stops, ``logit_bias``, ``allowed_token_ids``, ``bad_words``, log-probability
counts, ``n``, ``max_tokens``), the bounds they enforce, and the vLLM-field policy: which
fields each endpoint knows, and vLLM's fields that would change the answer, refused unless
at their neutral value.

``protocol.parse_common`` and the entry parsers call them; pure (no engine, no I/O), each
error an ``APIError`` whose ``param`` names the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.bad_words import MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS
from engine.sampling_params import MAX_ALLOWED_TOKEN_IDS, InvalidRequestError, check_max_tokens
from engine.server.request_fields import (
    APIError,
    bad_type,
    get_bool,
    get_int,
    is_int,
    is_number,
    type_name,
    unsupported,
)
from engine.structured.spec import FIELDS as STRUCTURED_FIELDS

if TYPE_CHECKING:
    from engine.server.protocol import BaseRequest

# Bounds of a request's stop lists (OpenAI allows 4 stop strings; vLLM has no bound).
# Each output token is checked against them, and with min_tokens the stop ids are masked
# in every step: unbounded, one request set the pace of every request on its node.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all stop strings together
MAX_STOP_TOKEN_IDS = 1024
# logit_bias entries: added to every step's logits of the request (OpenAI's bound is lower).
MAX_LOGIT_BIAS = 1024
LOGIT_BIAS_CLAMP = 100.0  # each bias is clamped to [-100, 100] (vLLM, OpenAI's range)
# Choices of one request: ``n`` times the prompts of a batch (OpenAI's bound on ``n``).
# Each is its own engine request (a P/D pair through the proxy).
MAX_CHOICES = 128
INT64_MAX = 2**63 - 1
# vLLM's ``cache_salt`` (prefix-cache isolation): hashed into a request's first KV block
# and its proxy routing key; a tenant's secret needs no more (vLLM suggests 43 characters).
MAX_CACHE_SALT_CHARS = 1024
# OpenAI's ``prompt_cache_key`` (which cache a request should go to: the proxy's routing
# affinity): OpenAI's bound.
MAX_PROMPT_CACHE_KEY_CHARS = 64


def parse_stop(body: dict[str, Any]) -> list[str]:
    """``stop``: a string or an array of strings (empty ones dropped), at most
    ``MAX_STOP_STRINGS`` of ``MAX_STOP_CHARS`` characters in all."""
    stop = body.get("stop")
    if stop is None:
        out = []
    elif isinstance(stop, str):
        out = [stop] if stop else []
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        out = [s for s in stop if s]
    else:
        raise bad_type("stop", "a string or an array of strings", stop)
    # Every token of the request is checked against them on the node's event loop.
    _check_strings_bound("stop", out, "strings", MAX_STOP_STRINGS, MAX_STOP_CHARS)
    return out


def parse_stop_token_ids(body: dict[str, Any]) -> list[int]:
    """vLLM's ``stop_token_ids``: non-negative ids, at most ``MAX_STOP_TOKEN_IDS``."""
    ids = body.get("stop_token_ids")
    if ids is None:
        out = []
    elif isinstance(ids, list) and all(is_int(t) and t >= 0 for t in ids):
        out = list(ids)
    else:
        raise bad_type("stop_token_ids", "an array of non-negative integers", ids)
    if len(out) > MAX_STOP_TOKEN_IDS:  # masked in every step (min_tokens)
        raise APIError(
            f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(out)}",
            param="stop_token_ids",
        )
    return out


def parse_logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's ``logit_bias``: ``{"<token id>": bias}``, biases clamped to [-100, 100].
    (Whether the ids are in the vocabulary is checked by the node, which knows it.)"""
    if bias is None:
        return {}
    what = "an object mapping token ids to numbers"
    if not isinstance(bias, dict):
        raise bad_type("logit_bias", what, bias)
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(
            f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}",
            param="logit_bias",
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        # Keys are decimal token ids ("50256"); 19 digits at most keeps them 64-bit.
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19):
            raise APIError(
                f"'logit_bias' keys must be token ids (non-negative integers), got {key!r:.40}",
                param="logit_bias",
            )
        if not is_number(value):
            raise APIError(
                f"'logit_bias' values must be numbers, got {type_name(value)} {value!r:.40} "
                f"for token {key}",
                param="logit_bias",
                code="invalid_type",
            )
        out[int(key)] = max(-LOGIT_BIAS_CLAMP, min(LOGIT_BIAS_CLAMP, float(value)))
    return out


def parse_allowed_token_ids(ids: Any) -> list[int] | None:
    """vLLM's ``allowed_token_ids``: a list of token ids; null or empty is every id (the
    field's neutral value before it was supported; vLLM refuses an empty list). (Whether
    the ids are in the vocabulary is checked by the node, which knows it.)"""
    if ids is None or ids == []:
        return None
    if not isinstance(ids, list):
        raise bad_type("allowed_token_ids", "an array of non-negative integers", ids)
    if len(ids) > MAX_ALLOWED_TOKEN_IDS:  # before the items: a long list is refused at once
        raise APIError(
            f"'allowed_token_ids' may hold at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(ids)}",
            param="allowed_token_ids",
        )
    if not all(is_int(t) and t >= 0 for t in ids):
        raise bad_type("allowed_token_ids", "an array of non-negative integers", ids)
    return list(ids)


def parse_bad_words(words: Any) -> tuple[str, ...]:
    """vLLM's ``bad_words``: a list of words (null or empty: none), each with a character
    besides white space, at most ``MAX_BAD_WORDS`` of ``MAX_BAD_WORDS_CHARS`` in all."""
    if words is None or words == []:
        return ()
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise bad_type("bad_words", "an array of strings", words)
    _check_strings_bound("bad_words", words, "words", MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS)
    if not all(w.strip() for w in words):
        raise APIError("'bad_words' may not hold an empty or blank word", param="bad_words")
    return tuple(words)


def parse_cache_salt(salt: Any) -> str | None:
    """vLLM's ``cache_salt``: None, or a non-empty string (vLLM's rule) of at most
    ``MAX_CACHE_SALT_CHARS`` characters."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise bad_type("cache_salt", "a non-empty string if provided", salt)
    if not salt:
        raise APIError("'cache_salt' must be a non-empty string if provided", param="cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise APIError(
            f"'cache_salt' may be at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}",
            param="cache_salt",
        )
    return salt


def parse_prompt_cache_key(key: Any) -> str | None:
    """OpenAI's ``prompt_cache_key``: None, or a string of at most
    ``MAX_PROMPT_CACHE_KEY_CHARS`` characters; an empty one is none (no affinity)."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise bad_type("prompt_cache_key", "a string", key)
    if len(key) > MAX_PROMPT_CACHE_KEY_CHARS:
        raise APIError(
            f"'prompt_cache_key' may be at most {MAX_PROMPT_CACHE_KEY_CHARS} characters, "
            f"got {len(key)}",
            param="prompt_cache_key",
        )
    return key or None


def logprobs_count(body: dict[str, Any], name: str) -> int | None:
    """A log-probability count: >= 0 (a node's --max-logprobs bounds it:
    ``request_checks.check_logprobs``)."""
    value = get_int(body, name, None)
    if value is not None and value < 0:
        raise APIError(f"'{name}' must be >= 0, got {value}", param=name)
    return value


def parse_chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (its alternatives) as one count:
    None without ``logprobs``, else ``top_logprobs`` or 0."""
    wanted = get_bool(body, "logprobs", False)
    top = logprobs_count(body, "top_logprobs")
    if top and not wanted:
        raise APIError("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    return (top or 0) if wanted else None


# Fields vLLM knows that would change the answer, refused unless at their neutral value
# (so a client relying on them is told, not silently ignored): name -> (is neutral, what).
def _neutral_none(v: Any) -> bool:
    return v is None or v == [] or v == {}


_VLLM_FIELDS: dict[str, tuple[Any, str]] = {
    "use_beam_search": (lambda v: v in (None, False), "= true (no beam search)"),
    "length_penalty": (lambda v: v in (None, 1, 1.0), "other than 1"),
    "logits_processors": (_neutral_none, ""),
}
_VLLM_CHAT_FIELDS: dict[str, tuple[Any, str]] = {
    "documents": (_neutral_none, ""),
}

COMMON_FIELDS = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
        "stop_token_ids", "ignore_eos", "stream", "stream_options", "kv_transfer_params",
        "user", "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "min_p", "min_tokens", "logprobs", "include_stop_str_in_output",
        "truncate_prompt_tokens", "return_tokens_as_token_ids", "return_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "prompt_logprobs", "priority", "bad_words", "cache_salt", "prompt_cache_key",
        "allowed_token_ids", *STRUCTURED_FIELDS, *_VLLM_FIELDS,
    }
)  # fmt: skip
# Every field each endpoint knows: supported, or refused at a value that would matter.
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "chat_template_kwargs", "chat_template",
    "top_logprobs", "tools",
    "add_generation_prompt", "continue_final_message", "echo", "parallel_tool_calls",
    "functions", "tool_choice", "function_call", "reasoning_effort", "truncate_messages_to",
    *_VLLM_CHAT_FIELDS,
}  # fmt: skip


def _reject_vllm_fields(body: dict[str, Any], fields: dict[str, tuple[Any, str]]) -> None:
    for name, (neutral, what) in fields.items():
        if name in body and not neutral(body[name]):
            raise unsupported(name, what)


def parse_n(body: dict[str, Any], req: BaseRequest) -> None:
    """``n`` choices per prompt, at most ``MAX_CHOICES`` choices in all; ``best_of`` only
    as ``n`` (all the choices drawn are returned)."""
    n = get_int(body, "n", 1)
    if n < 1:
        raise APIError(f"'n' must be at least 1, got {n}", param="n")
    req.n = n
    best_of = get_int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise unsupported("best_of", f"= {best_of} (only best_of = n, here {n})")
    choices = req.num_choices
    if choices > MAX_CHOICES:
        batch = getattr(req, "batch", None)
        what = f"{len(batch)} prompts x n = {n}" if batch else f"n = {n}"
        raise APIError(
            f"a request may ask for at most {MAX_CHOICES} choices, got {choices} ({what})",
            param="n" if n > 1 or not batch else "prompt",
        )
    if req.seed is not None and req.seed + n - 1 > INT64_MAX:
        raise APIError(
            f"'seed' + n - 1 must fit in a signed 64-bit integer (choice j samples with "
            f"seed + j), got seed {req.seed} with n = {n}",
            param="seed",
        )


def reject_unsupported(body: dict[str, Any], *, chat: bool) -> None:
    """vLLM's fields (and completions' ``suffix``) that would change the answer, refused
    unless at their neutral value."""
    _reject_vllm_fields(body, _VLLM_FIELDS)
    if chat:
        _reject_vllm_fields(body, _VLLM_CHAT_FIELDS)
    else:
        if body.get("suffix") not in (None, ""):
            raise unsupported("suffix", "")


def parse_max_tokens(body: dict[str, Any], name: str, default: int | None) -> int | None:
    """``max_tokens`` (or chat's ``max_completion_tokens``): None or an integer of at least
    1 (``check_max_tokens``); whether it fits the context is ``request_checks``' business."""
    value = get_int(body, name, default)
    if value is not None:
        try:
            check_max_tokens(value, name)
        except InvalidRequestError as e:
            raise APIError(str(e), param=e.param) from e
    return value


def _check_strings_bound(
    name: str, values: list[str], what: str, max_count: int, max_chars: int
) -> None:
    """A 400 naming ``name`` when ``values`` hold more than ``max_count`` strings or more
    than ``max_chars`` characters in all."""
    chars = sum(map(len, values))
    if len(values) > max_count or chars > max_chars:
        raise APIError(
            f"'{name}' may hold at most {max_count} {what} of {max_chars} characters in all, "
            f"got {len(values)} of {chars}",
            param=name,
        )
