"""``engine.heap.freeze_startup_heap``: after start-up, a full collection no longer walks
the start-up objects (torch, the app, the model): they are frozen."""

from __future__ import annotations

import gc

import torch  # noqa: F401  (a serving process's start-up heap: torch and the rest)

from engine.heap import freeze_startup_heap


def _leave_cyclic_garbage(n: int) -> None:
    """``n`` unreachable cycles in the oldest generation, which only a full collection
    frees: what a process that ran for a while holds (a pytest worker after a few hundred
    tests: 755k objects, 615k of them alive, failed this test when counted with them)."""
    cycles: list[list] = []
    for _ in range(n):
        cycle: list = []
        cycle.append(cycle)
        cycles.append(cycle)
    gc.collect()  # alive: moved to the oldest generation
    cycles.clear()  # now garbage that young collections do not look at


def test_frozen_startup_objects_are_not_walked_by_full_collections():
    _leave_cyclic_garbage(200_000)  # freezing collects it first: it is not counted
    gc.collect()
    before = len(gc.get_objects())  # the live objects
    assert before > 10_000  # pytest, torch, the engine's modules
    try:
        frozen = freeze_startup_heap("test")
        assert frozen >= before * 0.9
        assert len(gc.get_objects()) < before * 0.05  # what a full collection walks
        made_while_serving = [[i] for i in range(1000)]
        assert len(gc.get_objects()) >= len(made_while_serving)  # new objects still are
    finally:
        gc.unfreeze()
    assert len(gc.get_objects()) >= before * 0.9
