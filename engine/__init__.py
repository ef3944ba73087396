"""pdserve's engine. vLLM's offline names are importable from here, as from ``vllm``:
``from engine import LLM, SamplingParams`` (and ``RequestOutput``, ``CompletionOutput``),
imported on first use so that ``import engine.x`` loads nothing more."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.llm_outputs",
    "CompletionOutput": "engine.llm_outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
