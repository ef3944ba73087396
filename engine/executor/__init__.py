"""Executors: how an engine runs its TP ranks (``--distributed-executor-backend``).

``multiproc.MultiprocExecutor`` (``mp``): one worker process per rank. ``uniproc.UniProcExecutor``
(``uni``, TP 1): the rank in the engine's own process. Both take the same arguments and
give the engine the same interface.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig


def make_executor(
    config: EngineConfig,
    decide_num_blocks: Callable[[list[int | None]], int],
    log_level: str = "INFO",
) -> Any:
    """The executor ``config.parallel.distributed_executor_backend`` names (``auto``: mp;
    the offline ``LLM`` resolves its own ``auto`` first)."""
    if config.parallel.distributed_executor_backend == "uni":
        from engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, decide_num_blocks, log_level)
    from engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, decide_num_blocks, log_level)
