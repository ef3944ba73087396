"""Shared fixtures. The helpers they use (spawning, stopping by PID, metrics, SSE,
polling) live in ``harness.py``; HF reference models in ``hf_models.py``.

Markers: ``slow`` for every test that starts processes (nodes, proxies, engine worker
processes, NIXL peers, scripts), so ``pytest -m "not slow"`` runs the in-process unit
tests alone; ``gpu`` for tests that need CUDA. A test that uses one of the process
fixtures below is marked ``slow`` here; others that start processes say so themselves.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import PD, Procs, procs_in

PROCESS_FIXTURES = {"procs", "module_procs", "pd_pair"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def procs(tmp_path) -> Iterator[Procs]:
    """Nodes and proxies started by one test, stopped by PID when it ends."""
    with procs_in(tmp_path) as group:
        yield group


@pytest.fixture(scope="module")
def module_procs(tmp_path_factory: pytest.TempPathFactory, request) -> Iterator[Procs]:
    """Nodes and proxies shared by a module's tests, stopped after its last test."""
    with procs_in(tmp_path_factory.mktemp(request.module.__name__)) as group:
        yield group


@pytest.fixture(scope="module")
def pd_node_args() -> tuple[str, ...]:
    """The flags (besides ``--kv-connector nixl``) of ``pd_pair``'s nodes; a module that
    needs others overrides this fixture."""
    return ("--num-blocks", "256")


@pytest.fixture(scope="module")
def pd_pair(module_procs: Procs, pd_node_args: tuple[str, ...]) -> PD:
    """A prefill node and a decode node (NIXL over UCX), started together, module-wide."""
    return module_procs.pd(1, 1, *pd_node_args)
