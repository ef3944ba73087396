"""Where an engine step's time goes, as counters (typed, see ``engine.stats``).

For every step that went to the workers: the scheduler's ``schedule()`` and
``update_from_output()`` (the engine's host work), the executor's round trip (send the
step, every rank runs it, results back and aggregated), and inside that the slowest rank's
own time (from when it could start the step -- received, and its output of the step
before gone (async scheduling) -- to its output ready, ``WorkerOutput.busy_s``). The
round trip minus the worker is the executor's cost: pickling, pipes, wake-ups.

Rates of these counters split a step: e.g. ``rate(pdserve_engine_step_update_seconds_total)
/ rate(pdserve_engine_steps_total)`` is the update's mean per step. ``pd-bench offline``
prints the split per step (``StepStats.per_step_ms``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.stats import Stats, counter


@dataclass
class StepStats(Stats):
    steps_total: int = counter("Engine steps that went to the workers")
    step_schedule_seconds_total: float = counter("Time in the scheduler's schedule()")
    step_update_seconds_total: float = counter("Time in the scheduler's update_from_output()")
    step_execute_seconds_total: float = counter(
        "Time in the executor's round trip (every rank's step included)"
    )
    step_worker_seconds_total: float = counter(
        "Time the slowest TP rank spent on its step (inside the round trip)"
    )

    def per_step_ms(self, since: StepStats | None = None) -> dict[str, float]:
        """Mean milliseconds per step since ``since`` (or since the start): schedule,
        update, worker, and ipc (the round trip minus the worker)."""
        base = since or StepStats()
        n = self.steps_total - base.steps_total
        if n <= 0:
            return {}

        def ms(name: str) -> float:
            return 1000.0 * (getattr(self, name) - getattr(base, name)) / n

        execute, worker = ms("step_execute_seconds_total"), ms("step_worker_seconds_total")
        return {
            "steps": float(n),
            "schedule_ms": ms("step_schedule_seconds_total"),
            "update_ms": ms("step_update_seconds_total"),
            "ipc_ms": execute - worker,
            "worker_ms": worker,
        }
