"""Request checks the proxy makes before any node is touched.

The field-level validation is the node's own (``engine.server.protocol`` and its
neighbours ``field_parsers`` and ``request_checks``), imported, so the proxy and the nodes
accept exactly the same requests. On top of it the proxy checks what it can without a
tokenizer: the model name and ``max_tokens`` against the context length (the prompt's own
length is checked by the nodes, which answer 400 and are not retried). The prompt's
``PromptKey`` (``proxy/prefix.py``) is computed here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.server.chat_protocol import parse_chat_request
from engine.server.json_body import parse_json_body
from engine.server.protocol import BaseRequest, parse_completion_request
from engine.server.request_checks import (
    check_logprob_entries,
    check_model,
    logprob_entries,
)
from engine.server.request_fields import APIError
from proxy.prefix import PromptKey, prompt_key

COMPLETIONS = "completions"
CHAT = "chat"


@dataclass
class ProxyRequest:
    """A validated client request: the raw body (forwarded) and its parsed form."""

    endpoint: str  # COMPLETIONS or CHAT
    body: dict[str, Any]
    parsed: BaseRequest
    key: PromptKey | None = field(default=None, repr=False)  # for prefix-aware routing
    # With several choices (n > 1, a batch of prompts): one single-choice request each,
    # prompt-major (``BaseRequest.children``), each served on its own pair.
    children: list[ProxyRequest] = field(default_factory=list, repr=False)

    @property
    def chat(self) -> bool:
        return self.endpoint == CHAT

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def stream(self) -> bool:
        return self.parsed.stream


# Tokens a chat template may add to what the request's body holds (role headers, a default
# system prompt): the proxy has no tokenizer, so a chat prompt's size is bounded from above.
CHAT_TEMPLATE_TOKENS = 1024
# Special tokens a tokenizer may add to a completion prompt's text (BOS, a dummy prefix).
SPECIAL_TOKENS = 8


def validate_request(
    endpoint: str,
    raw: bytes,
    model_names: list[str],
    max_model_len: int | None,
    max_logprob_entries: int | None = None,
) -> ProxyRequest:
    """Parse and check one request; raises ``APIError`` (400) naming the problem.
    ``max_logprob_entries``: ``--max-logprob-entries`` (None: not checked)."""
    body = parse_json_body(raw)
    parsed = parse_chat_request(body) if endpoint == CHAT else parse_completion_request(body)
    if parsed.kv_transfer_params is not None:
        raise APIError(
            "'kv_transfer_params' is set by the proxy and must not be sent by clients",
            param="kv_transfer_params",
            code="unsupported_parameter",
        )
    if len(model_names) == 1:
        check_model(parsed.model, model_names[0])
    elif parsed.model is not None and model_names and parsed.model not in model_names:
        raise APIError(
            f"The model '{parsed.model}' does not exist; this server serves "
            f"{', '.join(model_names)}",
            param="model",
            code="model_not_found",
        )
    limit = max_model_len
    if limit is not None and parsed.max_tokens is not None and parsed.max_tokens >= limit:
        name = parsed.max_tokens_param
        raise APIError(
            f"'{name}' is {parsed.max_tokens}, but this model's maximum context length "
            f"is {limit} tokens: the prompt's tokens plus '{name}' must fit in it",
            param=name,
            code="context_length_exceeded",
        )
    if parsed.truncate_prompt_tokens == -1 and limit is not None:
        # "The context length" made explicit: P and D keep the same tokens (a P with a
        # longer context than the decode nodes' would keep more than D does).
        body = {**body, "truncate_prompt_tokens": limit}
        parsed.truncate_prompt_tokens = limit
    cut = getattr(parsed, "truncate_messages_to", None)
    if cut == -1 and limit is not None:
        # ``/v1/responses``' ``truncation: "auto"``: both legs drop the same messages, cut
        # to the context the client's prompt and answer share (the decode nodes' least; a
        # prefill node with a longer context would keep more than D does).
        body = {**body, "truncate_messages_to": limit}
        parsed.truncate_messages_to = limit  # type: ignore[attr-defined]
    # Hashed here, off the event loop (a prompt may be megabytes).
    if parsed.num_choices == 1:
        return ProxyRequest(endpoint, body, parsed, prompt_key(parsed))
    req = ProxyRequest(endpoint, body, parsed, None, _children(endpoint, body, parsed))
    if max_logprob_entries is not None and (
        parsed.logprobs is not None or parsed.prompt_logprobs is not None
    ):
        entries = _logprob_entries_bound(req, len(raw), limit)
        check_logprob_entries(
            parsed, parsed.n, len(req.children), entries, max_logprob_entries, req.chat
        )
    return req


def _logprob_entries_bound(req: ProxyRequest, raw_bytes: int, limit: int | None) -> int:
    """At most how many log-probability entries the choices' answers hold, without a
    tokenizer: a token is at least a byte of the prompt's text (plus a few special ones; a
    chat template's own text: ``CHAT_TEMPLATE_TOKENS``), a prompt at most the context long,
    and an answer at most ``max_tokens`` (else the context: ``limit`` - 1)."""
    total = 0
    bounds: dict[int, int] = {}  # a prompt's bound, once for its n choices
    for j, child in enumerate(req.children):
        one = child.parsed
        tokens = bounds.get(j // req.parsed.n)
        if tokens is None:
            if req.chat:
                tokens = raw_bytes + CHAT_TEMPLATE_TOKENS
            elif one.prompt_token_ids is not None:  # type: ignore[attr-defined]
                tokens = len(one.prompt_token_ids)  # type: ignore[attr-defined]
            else:
                tokens = len((one.prompt_text or "").encode()) + SPECIAL_TOKENS  # type: ignore[attr-defined]
            for cap in (limit, one.truncate_prompt_tokens):
                if cap is not None and cap > 0:
                    tokens = min(tokens, cap)
            bounds[j // req.parsed.n] = tokens
        out = one.max_tokens if one.max_tokens is not None else max(0, (limit or 1) - 1)
        total += logprob_entries(one, tokens, out)
    return total


def _children(endpoint: str, body: dict[str, Any], parsed: BaseRequest) -> list[ProxyRequest]:
    """Each choice as the request a node answers: ``n`` = 1, its own prompt and seed."""
    out = []
    keys: dict[int, PromptKey | None] = {}  # a prompt's key, hashed once for its n choices
    for j, child in enumerate(parsed.children()):
        one = {k: v for k, v in body.items() if k not in ("n", "best_of")}
        if child.seed is not None:
            one["seed"] = child.seed
        if endpoint == COMPLETIONS:
            text = child.prompt_text  # type: ignore[attr-defined]
            one["prompt"] = text if text is not None else child.prompt_token_ids  # type: ignore[attr-defined]
        key = keys.get(j // parsed.n)
        if key is None:
            key = keys[j // parsed.n] = prompt_key(child)
        out.append(ProxyRequest(endpoint, one, child, key))
    return out
