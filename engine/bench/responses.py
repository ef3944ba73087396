"""``pd-bench serve`` on OpenAI's Responses API (``--endpoint /v1/responses``,
``--backend openai-responses``): the request body and the timing of its event stream.

A request is streamed (``stream: true``) with the prompt's text as ``input`` and
``--output-len`` as ``max_output_tokens`` (the sampling extras, ``ignore_eos`` among
them, are passed as on the chat endpoint). Its events are typed (``event:`` +
``data:``), with no ``[DONE]``: the stream ends with ``response.completed`` (or
``response.incomplete``, the answer cut by ``max_output_tokens``: what ``--ignore-eos``
asks for), which carries the whole response and its ``usage``; ``response.failed`` or
an ``error`` event fails the request. Timing: TTFT is send -> the first delta that
carries generated text, ITL the gaps between such deltas -- ``response.output_text
.delta``, and also the deltas of reasoning text and function-call arguments, which are
generated tokens too (the chat endpoint's chunks carrying them are timed likewise). The
deltas carry no token ids: the output tokens are the final event's
``usage.output_tokens``. A token whose text is empty (a special token skipped, a UTF-8
sequence not complete yet) makes no delta: an answer without any text cannot be timed
and fails with "no text received".

Imports no torch (``pd-bench serve`` runs where only the proxy is installed).
"""

from __future__ import annotations

import time
from typing import Any

from engine.bench.stats import RequestResult, TokenClock
from engine.httpkit.sse_reader import SSEReader

RESPONSES_ENDPOINT = "/v1/responses"
# The deltas of generated text (one chat chunk's worth each, as a node streams them).
TOKEN_EVENTS = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
    }
)
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete"})
MAX_ERROR_CHARS = 300


def is_responses(path: str) -> bool:
    """Whether an endpoint path or URL is the Responses API's."""
    return path.rstrip("/").endswith(RESPONSES_ENDPOINT)


def responses_body(
    text: str, model: str | None, max_tokens: int, temperature: float, ignore_eos: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input": text,
        "max_output_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "stream": True,
    }
    if model:
        body["model"] = model
    return body


def _count(obj: Any, key: str) -> int | None:
    """``obj[key]`` when it is a count (the server's answer is checked, not trusted)."""
    value = obj.get(key) if isinstance(obj, dict) else None
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None


def _error_of(event: dict[str, Any]) -> str:
    """A failed stream's error message: an ``error`` event's, or ``response.failed``'s."""
    err = event.get("error")
    if err is None and event.get("type") == "error":  # OpenAI's: the fields at the top
        err = event.get("message")
    if err is None and isinstance(event.get("response"), dict):
        err = event["response"].get("error")
    if isinstance(err, dict):
        err = err.get("message", err)
    return str(err if err is not None else event)[:MAX_ERROR_CHARS]


async def read_events(lines: Any, r: RequestResult, start: float) -> None:
    """Time one Responses stream (``lines``: its text lines) into ``r``; ``start``: the
    send time (``perf_counter``). Sets ``r.error`` when the stream fails or ends without
    its final event, or when that event has no usage."""
    clock = TokenClock(r, start)
    final: dict[str, Any] | None = None
    async for event in SSEReader(lines):
        if not isinstance(event, dict):  # no event a server sends: skipped
            continue
        kind = event.get("type")
        if kind in TOKEN_EVENTS:
            if not event.get("delta"):
                continue
            clock.tick()
        elif kind in FINAL_EVENTS:
            final = event.get("response")
            break
        elif kind in ("response.failed", "error") or (kind is None and "error" in event):
            r.error = f"stream error: {_error_of(event)}"
            return
    r.e2e = time.perf_counter() - start
    if not isinstance(final, dict):
        r.error = "stream ended without response.completed"
        return
    usage = final.get("usage")
    output = _count(usage, "output_tokens")
    if output is None:
        r.error = "response.completed has no usage.output_tokens"
        return
    r.output_tokens = r.usage_completion_tokens = output
    prompt = _count(usage, "input_tokens")
    if prompt:
        r.prompt_tokens = prompt
    if r.ttft is None:  # tokens that decode to no text make no delta: nothing to time
        r.error = f"no text received ({output} output tokens)"
        return
    r.ok = True
