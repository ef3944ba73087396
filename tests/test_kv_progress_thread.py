"""``--kv-progress-thread``: NIXL's UCX progress thread busy-polls a core per agent, idle or
not (measured: a P or D worker at 100% of a core with no request in sight, which on a CPU
box took the cores P's prefill needed). ``auto`` turns it off on CPU; the workers poll
their open transfers themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig, KVTransferConfig, ParallelConfig
from kvconnector.nixl.worker import progress_thread

nixl_transport = pytest.importorskip("kvconnector.nixl.transport")
if not nixl_transport.NIXL_AVAILABLE:
    pytest.skip("nixl not installed", allow_module_level=True)


PROBE = """
import os, sys, uuid, torch
from kvconnector.nixl.transport import NixlTransport
before = len(os.listdir("/proc/self/task"))
kv = torch.zeros(4, 2, 2, 1, 4, 8)  # [block, layer, kv, head, token, dim]
t = NixlTransport(f"T-{uuid.uuid4().hex[:6]}", kv, kv[0].numel() * 4,
                  progress_thread=sys.argv[1] == "on")
print(len(os.listdir("/proc/self/task")) - before)
t.close()
"""


def _new_threads(progress: str) -> int:
    """Threads a fresh process has after creating one transport (UCX's own included)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, progress],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


def test_without_the_progress_thread_a_transport_starts_no_thread_of_its_own():
    assert _new_threads("on") == _new_threads("off") + 1  # the busy-polling one


@pytest.mark.parametrize(
    ("mode", "device", "want"),
    [("auto", "cpu", False), ("auto", "cuda", True), ("on", "cpu", True), ("off", "cuda", False)],
)
def test_auto_is_off_on_cpu_and_on_with_cuda(mode, device, want):
    cfg = EngineConfig(
        parallel=ParallelConfig(device=device),
        kv_transfer=KVTransferConfig(kv_connector="nixl", kv_progress_thread=mode),
    )
    assert progress_thread(cfg) is want
