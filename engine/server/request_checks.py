"""Checks of a parsed request made after the parse, with what the parser does not know:
the node's facts (served names, context length, vocabulary size, ``--max-logprobs``) and a
structured output's grammar (compiled: milliseconds, so callers run it off the event loop).

The node's HTTP layer (``job_builder``, ``tokenize``) and the proxy (``proxy/validation.py``,
``proxy/serving.py``) call them on what ``protocol`` and ``chat_protocol`` parsed. Each
error is an ``APIError`` whose ``param`` names the field.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.sampling_params import InvalidRequestError
from engine.server.protocol import BaseRequest
from engine.server.request_fields import APIError
from engine.structured.compiler import StructuredOutputUnavailable, check_structured_output
from engine.structured.spec import StructuredOutput


def check_model(requested: str | None, served: str | Sequence[str]) -> None:
    """``requested`` (a request's ``model``) is one of the ``served`` names, or None."""
    names = [served] if isinstance(served, str) else list(served)
    if requested is not None and requested not in names:
        raise APIError(
            f"The model '{requested}' does not exist; this server serves "
            + ", ".join(f"'{n}'" for n in names),
            param="model",
            code="model_not_found",
        )


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the context
    length; None: all). More than the context is a 400, as vLLM answers."""
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    if keep > max_model_len:
        raise APIError(
            f"'truncate_prompt_tokens' ({keep}) is greater than this model's context length "
            f"({max_model_len})",
            param="truncate_prompt_tokens",
        )
    return ids[-keep:] if len(ids) > keep else ids


def check_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise APIError(
                f"token id {t} in '{param}' is out of range [0, {vocab_size})", param=param
            )


def resolve_max_tokens(
    max_tokens: int | None,
    prompt_len: int,
    max_model_len: int,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> int:
    """Check the context budget and return the completion budget.

    ``max_tokens=None`` (chat without a limit) means "the rest of the context";
    ``max_tokens_param``: the field it came from, named by the error.
    """
    if prompt_len <= 0:
        raise APIError(f"'{prompt_param}' must not be empty", param=prompt_param)
    if prompt_len >= max_model_len and max_tokens is None:
        max_tokens = 1  # report the prompt as the problem below
    if max_tokens is None:
        return max_model_len - prompt_len
    total = prompt_len + max_tokens
    if total > max_model_len:
        where = "messages" if prompt_param == "messages" else "prompt"
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({prompt_len} in the {where}, {max_tokens} for the "
            f"completion). Please reduce the length of the {where} or completion.",
            param=prompt_param if prompt_len >= max_model_len else max_tokens_param,
            code="context_length_exceeded",
        )
    return max_tokens


def check_logprobs(req: BaseRequest, limit: int, chat: bool) -> None:
    """The request's log-probability counts within a node's ``--max-logprobs``."""
    asked = [("top_logprobs" if chat else "logprobs", req.logprobs)]
    asked.append(("prompt_logprobs", req.prompt_logprobs))
    for name, k in asked:
        if k is not None and k > limit:
            raise APIError(
                f"'{name}' is {k}, more than this server allows (--max-logprobs {limit})",
                param=name,
            )


def logprob_entries(req: BaseRequest, prompt_tokens: int, max_tokens: int) -> int:
    """The most log-probability entries one choice's answer may hold: each prompt token's
    ``prompt_logprobs`` + 1 (the token and its alternatives), with ``logprobs`` each output
    token's (and, with ``echo``, each prompt token's) ``logprobs`` + 1."""
    entries = 0
    if req.prompt_logprobs is not None:
        entries += prompt_tokens * (req.prompt_logprobs + 1)
    if req.logprobs is not None:
        echoed = prompt_tokens if req.echo else 0
        entries += (echoed + max_tokens) * (req.logprobs + 1)
    return entries


def check_logprob_entries(
    req: BaseRequest, n: int, choices: int, entries: int, limit: int, chat: bool
) -> None:
    """A 400 when a request of several ``choices`` (``n`` per prompt) would answer more
    than ``limit`` log-probability entries (``entries``, all choices together), naming what
    to lower."""
    if choices <= 1 or entries <= limit:
        return
    asked = [
        f"'{name}' {k}"
        for name, k in (
            ("prompt_logprobs", req.prompt_logprobs),
            ("top_logprobs" if chat else "logprobs", req.logprobs),
        )
        if k is not None
    ]
    raise APIError(
        f"the answer's {choices} choices would hold up to {entries} log-probability entries "
        f"({', '.join(asked)}: each token's alternatives + 1, per prompt token and per "
        f"output token up to 'max_tokens'), more than this server allows "
        f"(--max-logprob-entries {limit}): ask for fewer choices ('n', or fewer prompts), "
        "fewer alternatives, or a smaller 'max_tokens'",
        param="n" if n > 1 else "prompt",
    )


def check_structured(so: StructuredOutput | None) -> None:
    """A request's structured output checked (its grammar is valid, within the limits):
    a 400 naming its field otherwise, and when ``llguidance`` is missing. Not part of the
    parse (it may take milliseconds: callers run it off the event loop); cached."""
    if so is None:
        return
    try:
        check_structured_output(so)
    except StructuredOutputUnavailable as e:
        raise APIError(str(e), param=e.param, code="unsupported_parameter") from e
    except InvalidRequestError as e:
        raise APIError(str(e), param=e.param, code="invalid_structured_output") from e
