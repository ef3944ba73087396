"""The chaos suite's ``POST /v1/responses`` requests: a chat request of the workload asked
as the Responses API asks it, and its answer read back -- a ``response`` object, or the
stream's typed events -- as the text and finish reason the chat reference is checked
against (the Responses API gives no token ids)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from chaos_config import STRUCTURED
from harness import GREEDY, MODEL

# A response's status as a chat choice's finish reason.
FINISH = {"completed": "stop", "incomplete": "length"}


def responses_body(prompt: str, max_tokens: int, stream: bool, structured: int) -> dict[str, Any]:
    """The request (its structured output, a JSON schema, as ``text.format``)."""
    body = {"model": MODEL, "input": prompt, "max_output_tokens": max_tokens, **GREEDY}
    if stream:
        body["stream"] = True
    if structured >= 0:
        schema = STRUCTURED[structured]["response_format"]["json_schema"]
        body["text"] = {"format": {"type": "json_schema", **schema}}
    return body


def output_text(response: dict[str, Any]) -> str:
    """The text of a ``response`` object's message items."""
    return "".join(
        part.get("text") or ""
        for item in response.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    )


def body_outcome(body: Any) -> tuple[str, str | None, str]:
    """A 200 body's (outcome, finish reason or error, text)."""
    if not isinstance(body, dict) or body.get("object") != "response":
        return "broken", f"200 that is no response object: {str(body)[:120]}", ""
    finish = FINISH.get(body.get("status"))
    if finish is None:
        return "errored", f"response status {body.get('status')!r}", ""
    return "completed", finish, output_text(body)


@dataclass
class ResponsesStream:
    """What a stream's events said so far."""

    text: str = ""
    finish: str | None = None
    error: str | None = None
    ended: bool = False  # its last event (completed, incomplete or failed) came
    final_text: str | None = None  # the final response object's text
    usage: Any = None  # the final response object's usage

    def feed(self, data: str) -> str | None:
        """One ``data:`` line; what is wrong with it (None: nothing)."""
        try:
            ev = json.loads(data)
        except ValueError:
            return f"event not JSON: {data[:80]!r}"
        kind = ev.get("type") if isinstance(ev, dict) else None
        if kind == "response.output_text.delta":
            self.text += ev.get("delta") or ""
        elif kind in ("response.completed", "response.incomplete"):
            self.ended = True
            response = ev.get("response") or {}
            self.finish = FINISH.get(response.get("status"))
            self.final_text = output_text(response)
            self.usage = response.get("usage")
        elif kind == "response.failed":
            self.ended = True
            err = (ev.get("response") or {}).get("error") or {}
            self.error = f"event {err.get('code')}: {str(err.get('message'))[:160]}"
        elif kind == "error":  # a failure's, said before its response.failed
            if self.ended:
                return f"an error event after the last one: {data[:80]!r}"
        elif not isinstance(kind, str) or not kind.startswith("response."):
            return f"not a Responses API event: {data[:80]!r}"
        return None
