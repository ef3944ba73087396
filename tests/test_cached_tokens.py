"""Prompt tokens served from the prefix cache: the offline ``RequestOutput``'s
``num_cached_tokens`` and, on a node with ``--enable-prompt-tokens-details`` (vLLM's
flag), the usage's ``prompt_tokens_details.cached_tokens`` -- absent without the flag, and
(as vLLM) absent when nothing was cached."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine import LLM, SamplingParams

# 80 one-byte tokens of the tiny model: 5 full blocks of 16.
PROMPT = "The quick brown fox jumps over the lazy dog, again and again, until it tires out."


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(model="tiny", device="cpu", num_blocks=128, max_model_len=256) as engine:
        yield engine


def test_offline_num_cached_tokens_of_a_repeated_prompt(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([PROMPT], sp)[0]
    again = llm.generate([PROMPT], sp)[0]
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    # Every full block but the one holding the last prompt token (it is computed again).
    assert again.num_cached_tokens == (n - 1) // 16 * 16 > 0
