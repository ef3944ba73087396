"""vLLM's chat ``echo`` put before a parsed answer's message.

With ``echo`` the final message's text leads the answer's ``content`` (a stream says it
first, in its role chunk). A message parsed into reasoning or tool calls also says where
its parts sit in that content -- ``before_tool_calls`` (each call's characters of content
before it) and ``before_reasoning`` (the content a stream says before the reasoning) --
so they count the echo too: the places are in the content the client sees.
"""

from __future__ import annotations

from typing import Any

from engine.reasoning.output import BEFORE_REASONING
from engine.tools.output import BEFORE_TOOL_CALLS


def lead_with(message: dict[str, Any], echo: str) -> dict[str, Any]:
    """``message`` (a body's, parsed) with ``echo`` before its content, the places of its
    calls and its reasoning moved past it."""
    if not echo:
        return message
    out = {**message, "content": echo + (message.get("content") or "")}
    marks = message.get(BEFORE_TOOL_CALLS)
    if isinstance(marks, list):
        out[BEFORE_TOOL_CALLS] = [{**m, "chars": m["chars"] + len(echo)} for m in marks]
    before = message.get(BEFORE_REASONING)
    if isinstance(before, dict):
        out[BEFORE_REASONING] = {**before, "content": echo + before["content"]}
    elif message.get("reasoning_content"):  # a stream says the echo before the reasoning
        out[BEFORE_REASONING] = {"content": echo, "tool_calls": 0, "tokens": 0}
    return out
