"""The parts of a Responses API ``response`` object made from a chat completion: its
output items (reasoning, message, function calls), status, usage and error. The object
itself, streamed or not, is built by ``stream.py``."""

from __future__ import annotations

import time
from typing import Any

from engine.httpkit.admission import OVERLOADED_CODE
from engine.httpkit.error_status import event_status
from engine.responses_api.request import ResponseEcho

# A failed response's code for a context too long (OpenAI's API's; not on its SDK's list).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

# Chat request fields as the Responses API names them, for the ``param`` of an error.
PARAM_NAMES = (
    ("messages", "input"),
    ("max_tokens", "max_output_tokens"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("reasoning_effort", "reasoning.effort"),
    ("tool_choice.function", "tool_choice"),
)


def responses_param(param: Any) -> Any:
    """A chat request's field name as the Responses API names it (``tools[0].function.
    name`` -> ``tools[0].name``; ``messages[2]`` -> ``input``: instructions and merged
    function calls shift the indices, so none is given)."""
    if not isinstance(param, str):
        return param
    for chat, responses in PARAM_NAMES:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return responses if chat == "messages" else responses + param[len(chat) :]
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param


def response_id(chat_id: Any) -> str:
    """``resp_<id>`` from a chat completion's ``chatcmpl-<id>``."""
    text = str(chat_id or "")
    return "resp_" + (text.removeprefix("chatcmpl-") or "0")


def text_logprobs(chat_logprobs: Any) -> list[dict[str, Any]]:
    """A chat choice's ``logprobs`` as an ``output_text``'s (the same entries, as a list)."""
    if not isinstance(chat_logprobs, dict):
        return []
    out = []
    for e in chat_logprobs.get("content") or []:
        top = [
            {"token": t.get("token"), "logprob": t.get("logprob"), "bytes": t.get("bytes")}
            for t in e.get("top_logprobs") or []
        ]
        out.append(
            {
                "token": e.get("token"),
                "logprob": e.get("logprob"),
                "bytes": e.get("bytes"),
                "top_logprobs": top,
            }
        )
    return out


def _count(obj: Any, key: str) -> int:
    """``obj[key]`` when it is a count (an int, not negative), else 0: the usage comes
    from a node (through the proxy, over the network) and is repeated, never trusted."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def usage(chat_usage: Any) -> dict[str, Any] | None:
    """Chat ``usage`` in the Responses API's names. ``reasoning_tokens``: the node's count
    (``completion_tokens_details``: its answer's tokens in the reasoning part, counted on
    the token ids; a part of ``output_tokens``); 0 from a node that counts none (no
    ``--reasoning-parser``: no reasoning part)."""
    if not isinstance(chat_usage, dict):
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    prompt = chat_usage.get("prompt_tokens") or 0
    completion = chat_usage.get("completion_tokens") or 0
    reasoning = _count(chat_usage.get("completion_tokens_details"), "reasoning_tokens")
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": details.get("cached_tokens") or 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": chat_usage.get("total_tokens") or prompt + completion,
    }


def reasoning_item(rid: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {
        "id": "rs_" + rid,
        "type": "reasoning",
        "summary": [],
        "content": content,
        "status": status,
    }


def message_item(
    rid: str, text: str, status: str, logprobs: list[dict[str, Any]]
) -> dict[str, Any]:
    content = [] if status == "in_progress" else [output_text(text, logprobs)]
    return {
        "id": "msg_" + rid,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def output_text(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def function_call_item(
    rid: str, index: int, call_id: Any, name: Any, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": f"fc_{rid}_{index}",
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def error_event(error: Any) -> dict[str, Any]:
    """A stream's error event as the Responses API's ``error`` event's fields: its own
    ``code`` (a string; else its kind, as ``error_of``), message, and ``param`` named as
    the Responses API names it."""
    err = error if isinstance(error, dict) else {}
    code = err.get("code")
    param = responses_param(err.get("param"))
    return {
        "code": code if isinstance(code, str) and code else error_of(err)["code"],
        "message": str(err.get("message") or "the response failed"),
        "param": param if isinstance(param, str) else None,
    }


def error_of(error: Any) -> dict[str, str]:
    """A stream's error event as a failed response's ``error``. OpenAI's codes are a
    closed list, so the error's kind is told by the status it stands for
    (``event_status``): ``rate_limit_exceeded`` for load (429, a 503 ``overloaded``),
    ``invalid_prompt`` for the client's own error (any other 4xx: the request was
    refused), ``server_error`` for the rest; the error's own code follows the message.
    But a context too long is ``context_length_exceeded``: off the SDK's list, it is the
    code OpenAI's API sends, and the one the Codex CLI reads as not to be retried."""
    err = error if isinstance(error, dict) else {}
    code = err.get("code") or err.get("type")
    message = str(err.get("message") or "the response failed")
    status = event_status(err)
    if status == 429 or err.get("code") in (OVERLOADED_CODE, "too_many_requests"):
        kind = "rate_limit_exceeded"
    elif err.get("code") == CONTEXT_LENGTH_EXCEEDED:
        kind = CONTEXT_LENGTH_EXCEEDED
    elif 400 <= status < 500:
        kind = "invalid_prompt"
    else:
        kind = "server_error"
    return {
        "code": kind,
        "message": f"{message} ({code})" if code and code != "server_error" else message,
    }


def status_of(finish_reason: Any) -> tuple[str, dict[str, Any] | None]:
    """A response's ``status`` and ``incomplete_details`` from its choice's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def envelope(echo: ResponseEcho, rid: str, model: Any, created: Any, status: str) -> dict[str, Any]:
    """A ``response`` object without output yet (``response.created``'s)."""
    return {
        "id": response_id(rid),
        "object": "response",
        "created_at": created if created is not None else int(time.time()),
        "status": status,
        "model": model if model is not None else "",
        "output": [],
        "error": None,
        "incomplete_details": None,
        "usage": None,
        **echo.fields(),
    }
