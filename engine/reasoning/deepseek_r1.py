"""``deepseek_r1``: DeepSeek R1 (and QwQ): the chat template ends the prompt with
``<think>``, so the answer starts in its reasoning, up to ``</think>``; what follows is the
content. A ``<think>`` the model writes at the very start (R1-0528 does) is dropped. An
answer without ``</think>`` is all reasoning (vLLM's rule: the model was cut off while
thinking)."""

from __future__ import annotations

from engine.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    initial = "start"
