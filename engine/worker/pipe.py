"""What the engine process and its TP workers share over their pipes, free of torch.

The engine process (scheduler, HTTP server) never imports torch: its workers do. So the
pipe's vocabulary (``WAKE``, ``WorkerError``) and the process entry point live here, and
``worker_entry`` imports the worker (and torch) in the child only: the engine process
starts faster (torch's import is seconds on a slow host) and stays smaller.
"""

from __future__ import annotations

from typing import Any

# Sent by a worker on its result pipe when a transfer completed between steps: the engine
# runs the step that reports it at once (see ``engine.worker.worker_proc``).
WAKE = b"wake"


class WorkerError(Exception):
    """A worker failed a step; carries the rank and the worker's traceback."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"worker rank {rank}: {message}")
        self.rank = rank
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[int, str]]:  # pickled through the result pipe
        return (WorkerError, (self.rank, self.message))


def worker_entry(*args: Any) -> None:
    """A TP worker process's target: ``engine.worker.worker_proc.worker_main(*args)``."""
    from engine.worker.worker_proc import worker_main

    worker_main(*args)
