"""Starting a worker process by a deadline.

``Process.start()`` can block: from the fork server it waits for the server to report
the pid it forked (a server stopped, or stuck importing its preload from a hung file
system, never does); spawned, it writes the process's pickled state into the child's
pipe (over the pipe's 64 KiB, until the child reads it). ``start_within`` runs it in a
thread and gives up waiting at the deadline; the caller then ends what holds it
(``stop_fork_server``: the start reads the server's end and fails) and the thread with it.
"""

from __future__ import annotations

import threading
from multiprocessing.process import BaseProcess


class StartTimeout(Exception):
    """``proc.start()`` did not return in time; ``thread`` still runs it."""

    def __init__(self, thread: threading.Thread) -> None:
        super().__init__(f"{thread.name} did not return in time")
        self.thread = thread


def start_within(proc: BaseProcess, timeout: float) -> None:
    """``proc.start()``, waited for ``timeout`` seconds at most: ``StartTimeout`` past it
    (the start goes on in its thread), the start's own error if it failed."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            proc.start()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller
            failed.append(e)

    thread = threading.Thread(target=run, daemon=True, name=f"start-{proc.name}")
    thread.start()
    thread.join(max(0.0, timeout))
    if thread.is_alive():
        raise StartTimeout(thread)
    if failed:
        raise failed[0]
