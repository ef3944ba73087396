"""A new request checked against this node (``Scheduler.add_request``, for HTTP and
offline callers alike; the HTTP layer checks the request's shape): a ``priority`` the
policy would ignore, its id or its transfer id in use, its prompt empty, outside the
vocabulary or too long for the context. ``add_request`` then checks its KV blocks."""

from __future__ import annotations

from collections.abc import Container, Mapping

from engine.core.request import Request
from engine.sampling_params import InvalidRequestError


def check_request(
    request: Request,
    requests: Mapping[str, Request],
    quarantine: Container[str],
    *,
    by_priority: bool,
    vocab_size: int | None,
    max_model_len: int,
) -> None:
    """Raises ``InvalidRequestError`` for a request this node cannot take; ``requests``:
    the node's requests, ``quarantine``: the ids whose blocks are still quarantined."""
    rid = request.request_id
    if request.priority and not by_priority:
        raise InvalidRequestError(
            f"priority {request.priority} needs a node started with "
            "--scheduling-policy priority (this one starts requests in arrival order)",
            "priority",
        )
    if rid in requests or rid in quarantine:
        raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
    n = request.num_prompt_tokens
    if n == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    # vLLM's processor's check: an id past the embedding fails the step (on CUDA a
    # device assert). The HTTP layer checked its token-id prompts; the offline LLM's
    # are checked here.
    ids = request.prompt_token_ids
    vocab = vocab_size
    if vocab is not None and not 0 <= min(ids) <= max(ids) < vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise InvalidRequestError(
            f"token id {bad} in the prompt is out of range [0, {vocab})", "prompt"
        )
    # A prompt may fill the context (vLLM's engine: longer is refused): its one
    # sampled token ends it (a length) and is never computed, so it needs no room.
    # The HTTP layer lets it through only for echo with max_tokens 0.
    if n > max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens; this model's maximum context length is "
            f"{max_model_len} tokens",
            "prompt",
        )
    params = request.kv_transfer_params
    if params is not None and params.disaggregated and params.transfer_id is not None:
        # One leg per transfer and side (a kv_role=both node could hold both legs).
        tid, leg = params.transfer_id, params.do_remote_decode
        if any(
            (p := r.kv_transfer_params) is not None
            and p.transfer_id == tid
            and p.do_remote_decode == leg
            for r in requests.values()
        ):
            raise InvalidRequestError(
                f"transfer id {tid[:128]!r} is in use by another request on this node",
                "kv_transfer_params",
            )
