"""Ids and envelopes of OpenAI completion and chat objects (node and proxy build the same)."""

from __future__ import annotations

from typing import Any


def response_id(request_id: str, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def object_name(chat: bool, stream: bool) -> str:
    if not chat:
        return "text_completion"
    return "chat.completion.chunk" if stream else "chat.completion"


def envelope(
    request_id: str,
    chat: bool,
    stream: bool,
    created: int,
    model: str | None,
    choices: list[dict[str, Any]],
) -> dict[str, Any]:
    """``{"id", "object", "created", "model", "choices"}`` of one response or chunk."""
    return {
        "id": response_id(request_id, chat),
        "object": object_name(chat, stream),
        "created": created,
        "model": model,
        "choices": choices,
    }
