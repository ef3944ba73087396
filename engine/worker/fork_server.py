"""Imported by the TP workers' fork server (``engine.worker.pipe.worker_context``) when it
starts, before it forks any worker: it ignores SIGTERM, as the workers do.

``kill -TERM -PGID`` and systemd (``KillMode=control-group``) signal every process of the
node. The engine process drains and then shuts its workers down; a fork server ended by
that signal would take the workers with it (they leave when their parent does) and fail
the requests the drain is finishing. It leaves when the engine process does (its pipe to
it closes), or when ``stop_fork_server`` kills it.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
