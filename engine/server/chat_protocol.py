"""``/v1/chat/completions`` bodies: the messages (and the tool calls of their history),
the chat template's fields, tools, and the chat request built from them on top of the
fields every request shares (``protocol.parse_common``)."""

from __future__ import annotations

import json
from typing import Any

from engine.sampling_params import InvalidRequestError
from engine.server.field_parsers import parse_max_tokens
from engine.server.protocol import ChatCompletionRequest, parse_common
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
from engine.tools.spec import ToolCalling, parse_tool_calling

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
# vLLM's values of ``reasoning_effort`` (its ChatCompletionRequest's Literal).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# Content parts that are text, each in the key its type names: OpenAI's ``text`` and an
# assistant's ``refusal`` (vLLM reads a refusal as text too).
TEXT_PARTS = {"text": "text", "refusal": "refusal"}


def _message_content(content: Any, i: int) -> str:
    return text_of_parts(content, f"messages[{i}].content", TEXT_PARTS, "only 'text', 'refusal'")


def _parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    if body.get("messages") is None:
        raise APIError(
            "'messages' is required", param="messages", code="missing_required_parameter"
        )
    messages = body["messages"]
    if not isinstance(messages, list):
        raise bad_type("messages", "an array of messages", messages)
    if not messages:
        raise APIError("'messages' must not be empty", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise bad_type(f"messages[{i}]", "an object", msg)
        role = msg.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise APIError(
                f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}, got {role!r:.40}",
                param=f"messages[{i}].role",
            )
        if msg.get("function_call"):  # OpenAI's older form of tool_calls
            raise unsupported(f"messages[{i}].function_call", "(use 'tool_calls')")
        calls = msg.get("tool_calls")
        if calls and role != "assistant":
            raise APIError(
                f"'messages[{i}].tool_calls' is only allowed on assistant messages",
                param=f"messages[{i}].tool_calls",
            )
        content = msg.get("content")
        if content is None and role == "assistant":
            content = ""
        one: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _message_content(content, i)}  # fmt: skip
        if calls:
            one["tool_calls"] = _message_tool_calls(calls, f"messages[{i}].tool_calls")
        if role == "tool":
            for name in ("tool_call_id", "name"):
                value = msg.get(name)
                if value is not None and not isinstance(value, str):
                    raise bad_type(f"messages[{i}].{name}", "a string", value)
                if value is not None:
                    one[name] = value
        out.append(one)
    return out


def _message_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (the history of tool use) for the chat
    template: each ``{"id", "type": "function", "function": {"name", "arguments"}}``, its
    arguments (JSON text) parsed into an object as vLLM does for Hugging Face templates
    (they render ``arguments | tojson``); text that is not a JSON object stays text;
    null, absent or blank arguments are ``{}`` and a ``type`` other than "function" a 400
    (vLLM's ``_postprocess_messages``)."""
    if not isinstance(calls, list):
        raise bad_type(where, "an array of tool calls", calls)
    out: list[dict[str, Any]] = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise bad_type(at, "an object", call)
        if call.get("type", "function") != "function":
            raise APIError(
                f"'{at}.type' must be 'function' (chat completions call functions), "
                f"got {call.get('type')!r:.40}",
                param=f"{at}.type",
            )
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise bad_type(f"{at}.function", "an object with a 'name'", fn)
        name, args = fn.get("name"), fn.get("arguments")
        if args is None:
            args = {}
        if not isinstance(name, str):
            raise bad_type(f"{at}.function.name", "a string", name)
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                parsed = None
            args = parsed if isinstance(parsed, dict) else args
        elif not isinstance(args, dict):
            raise bad_type(f"{at}.function.arguments", "a string (JSON)", args)
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_type(f"{at}.id", "a string", call_id)
        one: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
        if call_id is not None:
            one["id"] = call_id
        out.append(one)
    return out


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A body's chat ``messages``, validated and normalized (also ``/tokenize``'s)."""
    return _parse_messages(body)


def parse_chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs``: an object of extra chat-template variables (``{}`` if absent);
    it may not replace ``messages``."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_type("chat_template_kwargs", "an object", kwargs)
    if "messages" in kwargs:
        raise APIError(
            "'chat_template_kwargs' may not set 'messages'", param="chat_template_kwargs"
        )
    return dict(kwargs)


def parse_chat_template(body: dict[str, Any], kwargs: dict[str, Any]) -> str | None:
    """A request's own chat template: vLLM's ``chat_template`` field, or a
    ``chat_template`` in ``chat_template_kwargs`` (taken out of ``kwargs``); None (or "")
    when it brings none."""
    template = get_str(body, "chat_template")
    if "chat_template" in kwargs:
        given = kwargs.pop("chat_template")
        if given is not None and not isinstance(given, str):
            raise bad_type("chat_template_kwargs.chat_template", "a string", given)
        template = template or given
    return template or None


def check_request_template(template: str | None, trusted: bool) -> None:
    """A request's chat template runs on the server: only on one that trusts it (vLLM's
    rule and flag)."""
    if template is not None and not trusted:
        raise APIError(
            "'chat_template' (the request's own chat template) is refused: this server was "
            "not started with --trust-request-chat-template",
            param="chat_template",
            code="unsupported_parameter",
        )


def parse_reasoning_effort(body: dict[str, Any]) -> str | None:
    """vLLM's ``reasoning_effort``: null or one of ``REASONING_EFFORTS`` (a 400 naming it
    otherwise, as vLLM's validation answers)."""
    value = body.get("reasoning_effort")
    if value is not None and value not in REASONING_EFFORTS:
        raise APIError(
            f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)} or null, "
            f"got {value!r:.40}",
            param="reasoning_effort",
        )
    return value


def thinking_kwargs(req: Any) -> dict[str, Any]:
    """A chat request's ``chat_template_kwargs`` with vLLM's ``enable_thinking`` from its
    ``reasoning_effort`` (false for "none", true for the others) where the request does
    not set it itself: what the template renders and the reasoning parser follows."""
    kwargs: dict[str, Any] = getattr(req, "chat_template_kwargs", {})
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None and "enable_thinking" not in kwargs:
        return {**kwargs, "enable_thinking": effort != "none"}
    return kwargs


def template_kwargs(req: ChatCompletionRequest, jinja: bool) -> dict[str, Any]:
    """The chat template's extra variables: ``chat_template_kwargs``, and on a Jinja
    template, when the request sets ``reasoning_effort``, that (vLLM passes it so, over a
    ``chat_template_kwargs`` one) and ``enable_thinking`` (``thinking_kwargs``); the
    built-in template has no variables."""
    if jinja and req.reasoning_effort is not None:
        return {**thinking_kwargs(req), "reasoning_effort": req.reasoning_effort}
    return req.chat_template_kwargs


def parse_generation_prompt(body: dict[str, Any]) -> tuple[bool, bool]:
    """``(add_generation_prompt, continue_final_message)``: vLLM's fields. Continuing the
    final message means no new assistant header (the default then); asking for both is
    a 400, as vLLM answers."""
    cont = get_bool(body, "continue_final_message", False)
    add = get_bool(body, "add_generation_prompt", not cont)
    if add and cont:
        raise APIError(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true: the "
            "first continues the final message, the second starts a new assistant message",
            param="continue_final_message",
        )
    return add, cont


def parse_truncate_messages_to(body: dict[str, Any]) -> int | None:
    """pdserve's ``truncate_messages_to``: -1 (the model's context length) or a context of
    at least 2 tokens (a prompt's one and an answer's one)."""
    keep = get_int(body, "truncate_messages_to", None)
    if keep is not None and keep < 2 and keep != -1:
        raise APIError(
            f"'truncate_messages_to' must be -1 (the model's context length) or at least 2, "
            f"got {keep}",
            param="truncate_messages_to",
        )
    return keep


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a ``/v1/chat/completions`` JSON body. ``max_tokens`` stays None if absent."""
    body = require_object(body)
    req = ChatCompletionRequest()
    req.messages = _parse_messages(body)
    req.chat_template_kwargs = parse_chat_template_kwargs(body)
    req.chat_template = parse_chat_template(body, req.chat_template_kwargs)
    req.add_generation_prompt, req.continue_final_message = parse_generation_prompt(body)
    req.reasoning_effort = parse_reasoning_effort(body)
    req.truncate_messages_to = parse_truncate_messages_to(body)
    mct = parse_max_tokens(body, "max_completion_tokens", None)
    mt = parse_max_tokens(body, "max_tokens", None)
    req.max_tokens = mct if mct is not None else mt
    if mct is not None:
        req.max_tokens_param = "max_completion_tokens"
    parse_common(body, req, chat=True)
    req.tools = parse_tools(body)
    try:
        constraint = req.tools.structured_output() if req.tools is not None else None
    except InvalidRequestError as e:  # a schema past the size bound
        raise APIError(str(e), param=e.param) from e
    if constraint is not None:
        if req.structured_output is not None:
            raise APIError(
                f"'tool_choice' (a named or \"required\" tool choice) constrains the answer "
                f"to tool calls, and '{req.structured_output.param}' asks for another "
                "structured output: a request may use one",
                param="tool_choice",
            )
        req.structured_output = constraint
    if get_bool(body, "echo", False):
        req.chat_echo = _chat_echo(req)
    return req


def _chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's rule: the answer's role is the assistant's (with ``add_generation_prompt``)
    or the final message's; the final message's text is echoed when it has that role."""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last["role"]
    content = last.get("content")
    return content if last["role"] == role and isinstance(content, str) else ""


def parse_tools(body: dict[str, Any]) -> ToolCalling | None:
    """A chat body's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (also
    ``/tokenize``'s): a 400 naming the field when they are wrong."""
    try:
        return parse_tool_calling(body)
    except InvalidRequestError as e:
        raise APIError(str(e), param=e.param) from e
