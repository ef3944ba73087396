"""``qwen3``: Qwen3 writes its reasoning between ``<think>`` and ``</think>`` itself;
an answer without ``<think>`` is all content. Text before the ``<think>`` is content
(vLLM's stream sends it so; its whole-answer path drops it: here both keep it), and an
answer that opened ``<think>`` and never closed it is reasoning to its end (vLLM's
stream). ``chat_template_kwargs: {"enable_thinking": false}`` (the template then closes
an empty thinking block in the prompt): the answer has no reasoning part, no parser."""

from __future__ import annotations

from typing import Any

from engine.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    initial = "before"

    @classmethod
    def applies(cls, chat_template_kwargs: dict[str, Any]) -> bool:
        return bool(chat_template_kwargs.get("enable_thinking", True))
