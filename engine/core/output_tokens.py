"""What a request's output tokens mean to it, and what it emits: the ending a new token
brings (a structured output that cannot go on, a stop id or EOS, the grammar's end,
``max_tokens`` or the context), the prefill node's first token checked before it is
taken, and the ``RequestOutput`` a request's new tokens make.

Functions of the request alone; the scheduler applies them (``Scheduler._append``, the one
place every output token goes, ``_remote_kv_landed``, ``_emit``) and ends the request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.core.request import Request, RequestStatus
from engine.outputs import RequestOutput

if TYPE_CHECKING:
    from kvconnector.params import KVTransferParams

logger = logging.getLogger(__name__)


class Ending(NamedTuple):
    """How a request ends: its status, and for an error, why and its code."""

    status: RequestStatus
    error: str | None = None
    error_code: str | None = None


def token_ending(req: Request, token: int, max_model_len: int) -> Ending | None:
    """The ending ``token``, just appended to ``req``, brings it; None: it goes on. Feeds
    the token to the request's grammar."""
    grammar = req.grammar
    if grammar is not None and not grammar.accept(token):
        if not grammar.masked_out(token):
            # Its mask allowed it (or, a prefill node's first token, ``allows`` did):
            # the matcher's own limits stopped it (llguidance's lexer or item bounds,
            # ``PARSER_LIMITS``), as a stuck grammar: the request's own doing.
            why = (
                f"the structured output cannot go on after {req.num_output_tokens - 1} "
                f"tokens: {grammar.error}"
            )
            logger.info("request %s: %s", req.request_id, why)
            return Ending(RequestStatus.FINISHED_ERROR, why, "structured_output_stuck")
        # Sampled outside the grammar's mask: a bug.
        logger.error(
            "request %s: output token %d is not allowed by its structured output (%s)",
            req.request_id, token, grammar.error,
        )  # fmt: skip
        return Ending(
            RequestStatus.FINISHED_ERROR,
            f"internal error: output token {token} does not follow the structured output",
            "structured_output_error",
        )
    sp = req.sampling_params
    stop = (not sp.ignore_eos and token in req.eos_token_ids) or token in req.stop_token_set
    if stop and req.num_output_tokens >= sp.min_tokens:  # before it they are masked
        return Ending(RequestStatus.FINISHED_STOPPED)
    if grammar is not None and grammar.finished:  # it took EOS (min_tokens, ignore_eos), or cannot
        # (none of its allowed_token_ids is an EOS: the grammar's last token ends it)
        req.ended_by_grammar = True
        return Ending(RequestStatus.FINISHED_STOPPED)
    if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= max_model_len:
        return Ending(RequestStatus.FINISHED_LENGTH)
    return None


def checked_first_token(req: Request, info: dict[str, Any], vocab_size: int | None) -> int | None:
    """The first token the prefill node sampled for ``req`` (its KV's ``info``), when it
    may be taken; None: the decode node computes it."""
    first = info.get("first_token")
    if first is not None and vocab_size is not None and not 0 <= first < vocab_size:
        logger.warning(
            "request %s: the prefill node's first token %.40r is not in the vocabulary "
            "(%d ids); computing it here",
            req.request_id, first, vocab_size,
        )  # fmt: skip
        return None
    if first is not None and req.grammar is not None and not req.grammar.allows(first):
        if req.grammar.is_error():  # llguidance failed: the request ends at its next mask
            logger.warning(
                "request %s: checking the prefill node's first token %d: %s",
                req.request_id, first, req.grammar.error,
            )  # fmt: skip
            return None
        # P did not sample it under this grammar (P and D with different reasoning
        # parsers, or a hand-made decode leg): the grammar decides here.
        logger.warning(
            "request %s: the prefill node's first token %d does not follow the "
            "request's structured output; computing it here",
            req.request_id, first,
        )  # fmt: skip
        return None
    return None if first is None else int(first)


def request_output(
    req: Request, kv_transfer_params: KVTransferParams | None = None
) -> RequestOutput:
    """``req``'s new tokens since its last output (taken), with its state; its prompt
    logprobs go with its first tokens."""
    ids, logprobs = req.take_new_outputs()
    prompt_logprobs = None
    if ids and req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
        req.prompt_logprobs_sent = True
        prompt_logprobs = req.prompt_logprobs
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=ids,
        finished=req.status.finished,
        finish_reason=req.status.finish_reason,
        error=req.error,
        error_code=req.error_code,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        kv_transfer_params=kv_transfer_params,
        new_logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        ended_by_grammar=req.ended_by_grammar,
        num_cached_tokens=req.num_cached_tokens,
    )
