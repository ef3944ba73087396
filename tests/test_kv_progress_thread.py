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


def _new_threads(*modes: str) -> list[int]:
    """For each progress mode, the threads a fresh process has after creating one
    transport (UCX's own included). The processes run at once: each imports torch."""
    probes = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE, mode],
            cwd=Path(__file__).resolve().parent.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode in modes
    ]
    counts = []
    try:
        for probe in probes:
            out, err = probe.communicate(timeout=120)
            assert probe.returncode == 0, err
            counts.append(int(out.strip().splitlines()[-1]))
    finally:
        for probe in probes:
            if probe.poll() is None:
                probe.kill()
                probe.wait(10)
    return counts


def test_without_the_progress_thread_a_transport_starts_no_thread_of_its_own():
    on, off = _new_threads("on", "off")
    assert on == off + 1  # the busy-polling one


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
