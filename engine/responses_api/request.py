"""A Responses API request translated into a chat completions request.

``to_chat`` checks what only the Responses API has (``input`` items, ``instructions``,
``max_output_tokens``, ``text.format``, ``reasoning``, function ``tools`` in their flat
form, the stored-state fields) and answers a 400 naming the Responses field; everything
the two APIs share (sampling values, the tools' schemas, the model name) is left to the
chat request's own checks. ``ResponseEcho`` keeps what the ``response`` object repeats
back to the client.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.server.request_fields import (
    APIError,
    bad_type,
    get_bool,
    get_int,
    get_str,
    require_object,
    text_of_parts,
    unsupported,
)

# Passed to the chat request as they are (vLLM's ResponsesRequest takes its sampling
# extras so too); the chat request checks them. ``prompt_cache_key`` too: the proxy routes
# the chat request by it.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
    "bad_words", "allowed_token_ids", "skip_special_tokens", "priority",
    "chat_template_kwargs", "include_stop_str_in_output", "cache_salt", "prompt_cache_key",
)  # fmt: skip
# Accepted and repeated back (or ignored): they change nothing here.
ECHOED_FIELDS = (
    "model", "input", "instructions", "max_output_tokens", "stream", "tools", "tool_choice",
    "parallel_tool_calls", "text", "reasoning", "store", "metadata", "user", "include",
    "top_logprobs", "truncation", "previous_response_id", "background", "service_tier",
    "safety_identifier", "stream_options", "max_tool_calls",
    "conversation", "prompt",
)  # fmt: skip
KNOWN_FIELDS = frozenset(SAMPLING_FIELDS) | frozenset(ECHOED_FIELDS)
# ``include`` values that change the answer here; the others are accepted and ignored.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INPUT_ROLES = ("user", "system", "developer", "assistant")
# Content parts that are text (their text under "text").
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text"}
TOOL_KEYS = ("name", "description", "parameters", "strict")
SCHEMA_FORMAT_KEYS = ("name", "schema", "strict", "description")
SCHEMA_FORMAT_TYPES = (
    ("name", str, "a string"), ("description", str, "a string"), ("strict", bool, "a boolean"),
)  # fmt: skip
VERBOSITIES = ("low", "medium", "high")
SUMMARIES = ("auto", "concise", "detailed")
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# Strings the ``response`` object repeats (in every event of a stream), at most this long:
# ``user`` (an end-user id), OpenAI's bound on ``safety_identifier``, and ``service_tier``
# (OpenAI's values are a few short words).
ECHOED_STRINGS = {"user": 512, "safety_identifier": 64, "service_tier": 64}


@dataclasses.dataclass(frozen=True)
class ResponseEcho:
    """What a ``response`` object repeats of its request (OpenAI's defaults where the
    request left a field out)."""

    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[Any]
    tool_choice: Any
    parallel_tool_calls: bool
    text: dict[str, Any]
    reasoning: dict[str, Any]
    metadata: dict[str, Any]
    user: str | None
    truncation: str
    top_logprobs: int | None
    service_tier: str | None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    ignored_fields: tuple[str, ...] = ()

    def fields(self) -> dict[str, Any]:
        """The ``response`` object's request fields."""
        out = dataclasses.asdict(self)
        del out["ignored_fields"]
        return {**out, "store": False, "background": False, "previous_response_id": None}


def to_chat(body: Any) -> tuple[dict[str, Any], ResponseEcho]:
    """The chat completions body serving Responses API request ``body``, and its echo;
    a 400 ``APIError`` naming the Responses field that is wrong or not supported."""
    body = require_object(body)
    _refuse_stored_state(body)
    _check_accepted(body)
    chat: dict[str, Any] = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    if "model" in body:
        chat["model"] = body["model"]
    instructions = get_str(body, "instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += _messages(body.get("input"))
    chat["messages"] = messages
    max_output = get_int(body, "max_output_tokens")
    if max_output is not None:
        if max_output < 1:
            raise APIError(
                f"'max_output_tokens' must be at least 1, got {max_output}",
                param="max_output_tokens",
            )
        chat["max_tokens"] = max_output
    if get_bool(body, "stream", False):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # the final event's usage
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    tool_choice: Any = "auto"
    if body.get("tool_choice") is not None:
        chat["tool_choice"], tool_choice = _tool_choice(body["tool_choice"])
    parallel = get_bool(body, "parallel_tool_calls", True)
    if "parallel_tool_calls" in body:
        chat["parallel_tool_calls"] = parallel
    text = _text(body, chat)
    reasoning = _reasoning(body, chat)
    _logprobs(body, chat)
    metadata = _metadata(body.get("metadata"))
    truncation = get_str(body, "truncation") or "disabled"
    if truncation not in ("disabled", "auto"):
        raise APIError(
            f"'truncation' must be 'disabled' or 'auto', got {truncation!r:.40}",
            param="truncation",
        )
    if truncation == "auto":  # the node cuts the rendered prompt (-1: to its context)
        chat["truncate_messages_to"] = -1
    echo = ResponseEcho(
        instructions=instructions,
        max_output_tokens=max_output,
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        # What the request set and nothing more: keys a client adds change nothing, and
        # a copy of them in every lifecycle event let one request stall the event loop.
        tools=[{"type": "function", **t["function"]} for t in tools],
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        text=text,
        reasoning=reasoning,
        metadata=metadata or {},
        user=get_str(body, "user"),
        truncation=truncation,
        top_logprobs=get_int(body, "top_logprobs"),
        service_tier=get_str(body, "service_tier"),
        prompt_cache_key=get_str(body, "prompt_cache_key") or None,
        safety_identifier=get_str(body, "safety_identifier"),
        max_tool_calls=get_int(body, "max_tool_calls"),
        ignored_fields=tuple(k for k in body if k not in KNOWN_FIELDS),
    )
    return chat, echo


def _metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's limits: at most 16 pairs, keys up to 64 characters, values strings up to
    512 (it is repeated in every ``response`` object a stream sends)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise bad_type("metadata", "an object", metadata)
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(
            f"'metadata' may hold at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise APIError(
                f"'metadata' keys are at most {MAX_METADATA_KEY} characters, got {len(key)}",
                param="metadata",
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise APIError(
                f"'metadata.{key}' must be a string of at most {MAX_METADATA_VALUE} characters",
                param=f"metadata.{key}",
            )
    return metadata


def _check_accepted(body: dict[str, Any]) -> None:
    """The types of the fields accepted and changing nothing here (a client's mistake in
    them is still told), and the lengths of those the response object repeats (in every
    event of a stream: ``ECHOED_STRINGS``)."""
    get_bool(body, "store", True)
    get_int(body, "max_tool_calls")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise bad_type("stream_options", "an object", body["stream_options"])
    for name, most in ECHOED_STRINGS.items():
        value = get_str(body, name)
        if value is not None and len(value) > most:
            raise APIError(f"'{name}' is at most {most} characters, got {len(value)}", param=name)


def _refuse_stored_state(body: dict[str, Any]) -> None:
    """What needs responses stored or run in the background: refused, as vLLM refuses it
    without its store (a client must send the whole conversation)."""
    why = "pdserve stores no responses: send the whole conversation in 'input'"
    for name in ("previous_response_id", "conversation", "prompt"):
        if body.get(name) is not None:
            raise unsupported(name, f"({why})")
    if get_bool(body, "background", False):
        raise unsupported("background", "= true (responses are answered while they run)")


def _messages(items: Any) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of items) as chat messages: message items as they
    are, ``function_call`` items as the previous assistant message's tool calls,
    ``function_call_output`` items as tool messages; ``reasoning`` items are dropped (chat
    templates leave past reasoning out)."""
    if items is None:
        raise APIError("'input' is required", param="input", code="missing_required_parameter")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_type("input", "a string or an array of input items", items)
    if not items:
        raise APIError("'input' must not be empty", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_type(where, "an object", item)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise APIError(
                    f"'{where}.role' must be one of {', '.join(INPUT_ROLES)}, got {role!r:.40}",
                    param=f"{where}.role",
                )
            out.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _required_str(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _required_str(item, "name", where),
                    "arguments": _required_str(item, "arguments", where),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _required_str(item, "call_id", where)
            output = item.get("output")
            text = output if isinstance(output, str) else _content(output, where, "output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise unsupported(
                f"{where}.type",
                f"= {kind!r:.40} (input items here: message, function_call, "
                "function_call_output, reasoning)",
            )
    if not out:  # reasoning items alone
        raise APIError(
            "'input' has no message, function_call or function_call_output: reasoning "
            "items are dropped (chat templates leave past reasoning out)",
            param="input",
        )
    return out


def _content(content: Any, where: str, name: str = "content") -> str:
    return text_of_parts(content, f"{where}.{name}", TEXT_PARTS, "text models take input_text only")


def _required_str(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_type(f"{where}.{name}", "a string", value)
    return value


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Function tools in their flat form, as chat's ``{"type": "function", "function":
    {...}}``; hosted tools (web search, file search, MCP, ...) are refused."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_type("tools", "an array of tools", tools)
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad_type(f"tools[{i}]", "an object", tool)
        if tool.get("type") != "function":
            raise unsupported(
                f"tools[{i}].type", f"= {tool.get('type')!r:.40} (function tools only)"
            )
        fn = {k: tool[k] for k in TOOL_KEYS if k in tool}
        _check_finite(fn, f"tools[{i}]")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple[Any, Any]:
    """``tool_choice`` as chat's, and as the ``response`` object repeats it."""
    if isinstance(choice, str):
        return choice, choice  # none / auto / required: chat's own check
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_type("tool_choice.name", "a function's name", name)
        return {"type": "function", "function": {"name": name}}, {"type": "function", "name": name}
    if isinstance(choice, dict):
        raise unsupported("tool_choice.type", f"= {choice.get('type')!r:.40} (function only)")
    raise bad_type("tool_choice", "a string or an object", choice)


def _text(body: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """``text.format`` as chat's ``response_format``; the echoed ``text`` (its known keys)."""
    text = body.get("text")
    if text is None:
        return {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise bad_type("text", "an object", text)
    echo: dict[str, Any] = {"format": {"type": "text"}}
    verbosity = text.get("verbosity")
    if verbosity is not None:
        if verbosity not in VERBOSITIES:
            raise bad_type("text.verbosity", f"one of {', '.join(VERBOSITIES)}", verbosity)
        echo["verbosity"] = verbosity
    fmt = text.get("format")
    if fmt is None:
        return echo
    if not isinstance(fmt, dict):
        raise bad_type("text.format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
        echo["format"] = {"type": "json_object"}
    elif kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_type("text.format.schema", "an object", fmt.get("schema"))
        for key, typ, expected in SCHEMA_FORMAT_TYPES:  # repeated back: as OpenAI types them
            if fmt.get(key) is not None and not isinstance(fmt[key], typ):
                raise bad_type(f"text.format.{key}", expected, fmt[key])
        spec = {k: fmt[k] for k in SCHEMA_FORMAT_KEYS if k in fmt}
        _check_finite(spec, "text.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
        echo["format"] = {"type": "json_schema", **spec}
    elif kind != "text":
        raise unsupported("text.format.type", f"= {kind!r:.40} (text, json_object or json_schema)")
    return echo


def _check_finite(value: Any, where: str) -> None:
    """No NaN or Infinity (Python's parser takes them; JSON has no such number) in what the
    ``response`` object repeats: it could not be written back (a 500; ``NaN`` in a stream's
    events). The chat request checks only what it uses (a schema a choice does not
    constrain by is not compiled)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(f"'{where}' must be a finite number, got {value}", param=where)
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, f"{where}.{key}")
    elif isinstance(value, list):
        for j, item in enumerate(value):
            _check_finite(item, f"{where}[{j}]")


def _reasoning(body: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return {"effort": None, "summary": None}
    if not isinstance(reasoning, dict):
        raise bad_type("reasoning", "an object", reasoning)
    if reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    summary = reasoning.get("summary")
    if summary is not None and summary not in SUMMARIES:
        raise bad_type("reasoning.summary", f"one of {', '.join(SUMMARIES)}", summary)
    return {"effort": reasoning.get("effort"), "summary": summary}


def _logprobs(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """Log probabilities when ``include`` names ``message.output_text.logprobs`` or
    ``top_logprobs`` asks for alternatives (vLLM's reading)."""
    include = body.get("include")
    if include is not None and (
        not isinstance(include, list) or not all(isinstance(x, str) for x in include)
    ):
        raise bad_type("include", "an array of strings", include)
    top = get_int(body, "top_logprobs")
    if top is not None and top < 0:
        raise APIError(f"'top_logprobs' must be at least 0, got {top}", param="top_logprobs")
    if INCLUDE_LOGPROBS in (include or ()) or top:
        chat["logprobs"] = True
        if top:
            chat["top_logprobs"] = top
