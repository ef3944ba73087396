"""What the HTTP layer needs from an engine (``AsyncLLMEngine`` implements it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    grammars: Any  # engine.structured.compiler.GrammarCompiler: structured outputs
    dead_reason: str | None

    @property
    def healthy(self) -> bool: ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: Any = None,
        label: str | None = None,
        priority: int = 0,
        grammar: Any = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str, reason: str = "abort") -> str | None:
        """``reason``: "stop" for a request ended at a stop string (its finish reason in
        the engine's metrics), else "abort". Returns, for "abort", the finish reason the
        request had ended with by itself before the abort reached the engine (its final
        output not yet read), which the engine's metrics count; else None."""
        ...

    async def settle(self, request_id: str, stop_string: bool) -> None:
        """A request whose engine output said it finished, its stop strings checked on the
        whole answer: whether one ended it (its finish reason in the engine's metrics)."""
        ...

    async def abort_matching(self, key: str, by: str = "request_id") -> list[str]: ...

    def stats(self) -> dict[str, float]: ...

    def kv_info(self) -> dict[str, Any]: ...
