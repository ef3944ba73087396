"""scripts/gpu_check.sh runs end to end at toy sizes on CPU (SMOKE=1), so the one GPU run a
session may get is not spent on a broken script."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_check_smoke_runs_every_step_and_prints_the_target_table(tmp_path):
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "steps not ok: none" in summary, summary + log[-5000:]
    rows = ("offline 32x512->128", "single stream", "colocated: ITL p99", "P/D: TTFT p50",
            "low load 1x1024", "P/D pipelined")  # fmt: skip
    for row in rows:
        line = next(ln for ln in summary.splitlines() if row in ln)
        assert "missing" not in line, summary
    for name in ("serve_colocated.json", "serve_pd.json", "offline_throughput.json"):
        assert (tmp_path / name).stat().st_size > 0
    # The multi-GPU test file ran (its placement tests; the GPU ones skip on CPU) and the
    # summary read its junit XML.
    row = next(ln for ln in summary.splitlines() if ln.startswith("| pytest_multi_gpu.xml"))
    passed, failed, _ = (int(c) for c in row.strip(" |").split("|")[1:4])
    assert passed >= 2 and failed == 0, summary
