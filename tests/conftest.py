"""Shared fixtures. The helpers they use (spawning, stopping by PID, metrics, SSE,
polling) live in ``harness.py``; HF reference models in ``hf_models.py``.

Markers: ``slow`` for every test that starts processes (nodes, proxies, engine worker
processes, NIXL peers, scripts), and for the long form of an in-process property test
(``test_property_engine.py``'s many examples), so ``pytest -m "not slow"`` runs the fast
in-process unit tests alone. A test that uses one of the process fixtures below is marked
``slow`` here; others say so themselves.

Hardware markers, each skipped here with a reason naming what is missing:
``gpu`` (a CUDA GPU), ``multi_gpu(n)`` (n CUDA GPUs), ``rdma`` (an RDMA device UCX can
use). The checks run only when such a test is about to run, once per session: CUDA is
asked ``torch.cuda.is_available()`` first (a CPU build answers without touching a
driver), ``ucx_info -d`` is run once. ``PDSERVE_TEST_HW_ON_CPU=1`` skips none of them:
the hardware tests then run their code on CPU (``--device cpu``), a dry run of the tests
themselves on a box without the hardware (see docs/deploy.md, "Running the hardware
tests").

``isolated``: the test runs in a child pytest process (``isolated.py``), so a crash in
native code fails that test, not the run (the UCXX tests that build ``ucxx`` workers in
the test process); ``isolated(batch=True)``: a module's tests so marked share one child
(a new one after a crash).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import isolated
import pytest
from harness import PD, Procs, procs_in

from engine.bench.cluster import PORT_RANGE_ENV, port_range

PROCESS_FIXTURES = {"procs", "module_procs", "pd_pair"}


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(isolated, "pdserve-isolated")  # @pytest.mark.isolated
    _own_port_slice()
    # pytest-xdist >= 3.6 hands ``--dist loadfile``'s files out by test count, most first
    # (its ``--loadscope-reorder``, on by default): that undoes LONGEST_FILES below.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _own_port_slice() -> None:
    """Under pytest-xdist (``-n N``) each worker picks ports from its own slice of
    ``free_port``'s range: two workers' nodes never get one port (a node binds its port
    seconds after it was picked)."""
    worker, count = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if not worker or not count or os.environ.get(PORT_RANGE_ENV):
        return
    span = port_range()
    if span is None:
        return
    index, n = int(worker.removeprefix("gw")), int(count)
    width = (span[1] - span[0]) // n
    low = span[0] + index * width
    os.environ[PORT_RANGE_ENV] = f"{low}-{low + width}"


# The longest test files go first, longest first (per-file sums of ``--durations``, two
# workers on two cores): with ``-n 2 --dist loadfile`` a long file handed out last leaves
# one worker running it alone at the end. The rest follow in their usual order; a stale
# entry only costs some balance. (xdist's own order, most tests first, is turned off in
# ``pytest_configure``: it put the long files with few tests last.)
LONGEST_FILES = (
    "test_gpu_check_script.py", "test_tool_calling.py", "test_structured_output.py",
    "test_overload.py", "test_chaos.py", "test_bench.py", "test_disagg_faults.py",
    "test_disagg_ucxx.py", "test_proxy_failover.py", "test_proxy.py", "test_fuzz_http.py",
    "test_server_http.py", "test_property_proxy_faults.py", "test_disagg.py",
    "test_fast_path_cpu.py", "test_proxy_prefix.py", "test_reasoning_structured.py",
    "test_drain.py", "test_property_http.py", "test_ucxx_transport.py",
    "test_triton_attention.py", "test_reserve_first.py", "test_bench_interference.py",
    "test_uniproc_executor.py", "test_logprobs.py", "test_property_engine.py",
    "test_choices.py", "test_request_metrics.py", "test_multiproc_executor.py",
    "test_property_disagg.py",
)  # fmt: skip
_FIRST = {name: i for i, name in enumerate(LONGEST_FILES)}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # Stable: a file's tests stay together and in order.
    items.sort(key=lambda item: _FIRST.get(item.path.name, len(LONGEST_FILES)))


# -- hardware markers ---------------------------------------------------------------------------

HW_ON_CPU_ENV = "PDSERVE_TEST_HW_ON_CPU"
# UCX's RDMA transports: rc_verbs, rc_mlx5, dc_mlx5, ud_verbs, ud_mlx5 (InfiniBand, RoCE).
RDMA_TRANSPORT = re.compile(r"^(rc|dc|ud)(_|$)")
SYS_INFINIBAND = Path("/sys/class/infiniband")


@functools.cache
def cuda_gpus() -> tuple[int, str]:
    """(CUDA GPUs visible, why none when 0)."""
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return 0, f"torch {torch.__version__} is a CPU build"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        return 0, f"torch.cuda.is_available() is False (CUDA_VISIBLE_DEVICES={visible})"
    return torch.cuda.device_count(), ""


def ucx_info_transports(text: str) -> list[tuple[str, str]]:
    """(transport, device) pairs of ``ucx_info -d`` output (its ``Transport:`` and
    ``Device:`` lines)."""
    pairs: list[tuple[str, str]] = []
    transport = None
    for line in text.splitlines():
        key, _, value = line.lstrip("# ").partition(":")
        if key == "Transport":
            transport = value.strip()
        elif key == "Device" and transport is not None:
            pairs.append((transport, value.strip()))
            transport = None
    return pairs


def active_ib_ports(root: Path = SYS_INFINIBAND) -> list[str]:
    """``DEVICE:PORT`` (UCX's device names, e.g. ``mlx5_0:1``) of every ACTIVE port under
    /sys/class/infiniband."""
    ports = []
    for state in sorted(root.glob("*/ports/*/state")):
        try:
            if "ACTIVE" in state.read_text():
                ports.append(f"{state.parent.parent.parent.name}:{state.parent.name}")
        except OSError:
            continue
    return ports


@functools.cache
def rdma_devices() -> tuple[tuple[str, ...], str]:
    """(RDMA transports/devices found, why none when empty): ``ucx_info -d`` (the
    ``ucx_info`` on PATH, or ``$PDSERVE_UCX_INFO``), else an ACTIVE port under
    /sys/class/infiniband (UCX's verbs transports use those)."""
    why = []
    exe = os.environ.get("PDSERVE_UCX_INFO") or shutil.which("ucx_info")
    if exe is None:
        why.append("ucx_info is not on PATH")
    else:
        try:
            proc = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            why.append(f"`{exe} -d` failed: {e}")
        else:
            pairs = ucx_info_transports(proc.stdout)
            found = [f"{t}/{d}" for t, d in pairs if RDMA_TRANSPORT.match(t)]
            if found:
                return tuple(found), ""
            listed = ", ".join(sorted({t for t, _ in pairs})) or "nothing"
            why.append(f"`ucx_info -d` lists no rc/dc/ud transport (only {listed})")
    ports = active_ib_ports()
    if ports:
        return tuple(ports), ""
    if not SYS_INFINIBAND.is_dir():
        why.append(f"{SYS_INFINIBAND} does not exist")
    else:
        why.append(f"no ACTIVE port under {SYS_INFINIBAND}")
    return (), "; ".join(why)


def gpus_wanted(mark: pytest.Mark) -> int:
    """``multi_gpu(n)``'s n (2 when not given)."""
    n = mark.args[0] if mark.args else mark.kwargs.get("n", 2)
    if not isinstance(n, int) or n < 1:
        raise pytest.UsageError(f"multi_gpu(n) needs a GPU count, got {n!r}")
    return n


def missing_hardware(item: pytest.Item) -> str | None:
    """Why ``item`` cannot run here (the first of its hardware markers not met), or None."""
    for mark in item.iter_markers():
        if mark.name == "gpu":
            n, why = cuda_gpus()
            if n < 1:
                return f"needs a CUDA GPU, none available: {why}"
        elif mark.name == "multi_gpu":
            want = gpus_wanted(mark)
            n, why = cuda_gpus()
            if n < want:
                return f"needs {want} CUDA GPUs, found {n}" + (f" ({why})" if why else "")
        elif mark.name == "rdma":
            found, why = rdma_devices()
            if not found:
                return f"needs an RDMA device visible to UCX: {why}"
    return None


_HARDWARE_SKIP = pytest.StashKey[str]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    # After skipif/skip markers (the skipping plugin runs first): a test that lacks its
    # environment says so before it is asked for hardware.
    if os.environ.get(HW_ON_CPU_ENV) == "1":
        return
    reason = missing_hardware(item)
    if reason:
        item.stash[_HARDWARE_SKIP] = reason
        pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A hardware skip is reported at the test, as a skip marker's is (not at this file)."""
    outcome = yield
    rep = outcome.get_result()
    if call.when == "setup" and rep.skipped and _HARDWARE_SKIP in item.stash:
        path, line = item.reportinfo()[:2]
        rep.longrepr = (str(path), (line or 0) + 1, f"Skipped: {item.stash[_HARDWARE_SKIP]}")


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
