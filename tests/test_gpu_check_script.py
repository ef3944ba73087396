"""scripts/gpu_check.sh runs end to end at toy sizes on CPU (SMOKE=1), so the one GPU run a
session may get is not spent on a broken script; what it leaves in ``$OUT`` fits what the
device tool brings back, and a short budget still ends in a summary."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What the device tool returns from $OUT (/work/.library/device/README.md, Limits).
MAX_FILES, MAX_FILE_BYTES, MAX_TOTAL_BYTES = 8, 16 * 2**20, 64 * 2**20


def _run(tmp_path: Path, timeout: float, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=ROOT,
        env={
            **os.environ,
            "SMOKE": "1",
            "OUT": str(out),
            "GPU_CHECK_WORK": str(tmp_path / "work"),
            **env,
        },  # fmt: skip
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, out


def _assert_fits_the_device_tool(out: Path) -> None:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= MAX_FILES, files
    assert all(p.stat().st_size <= MAX_FILE_BYTES for p in files), files
    assert sum(p.stat().st_size for p in files) <= MAX_TOTAL_BYTES
    assert all(len(p.relative_to(out).parts) <= 3 for p in files), files  # out/a/b/file at most
    assert not [p for p in files if p.suffix == ".safetensors"]


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_gpu_check_smoke_runs_every_step_and_prints_the_target_table(tmp_path):
    # ~2-3 min on 2 cores, but it starts beside the next longest files (the longest go
    # first): a budget far over the GPU's 470 s, so a loaded box never skips a step.
    proc, out = _run(tmp_path, 980, GPU_CHECK_BUDGET_S="940")
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    _assert_fits_the_device_tool(out)
    summary = (out / "summary.md").read_text()
    assert "steps not ok: none" in summary, summary + log[-5000:]
    assert "steps not ok: none" in proc.stdout  # the summary is in the tool's output tail too
    rows = ("offline 32x512->128", "single stream", "colocated: ITL p99", "P/D: TTFT p50",
            "low load 1x1024", "P/D pipelined", "a worker process",
            "structured JSON", "async / sync output tok/s")  # fmt: skip
    for row in rows:
        line = next(ln for ln in summary.splitlines() if row in ln)
        assert "missing" not in line, summary
    with tarfile.open(out / "results.tgz") as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers()}
    valid = next(ln for ln in summary.splitlines() if "outputs complete and valid" in ln)
    assert "| 4 / 4 of 4 |" in valid, summary  # every constrained output followed its schema
    for name in ("serve_colocated.json", "serve_pd.json", "offline_throughput.json",
                 "offline_structured.json"):  # fmt: skip
        assert members[name].size > 0, sorted(members)
    # The multi-GPU test file ran (its placement tests; the GPU ones skip on CPU) and the
    # summary read its junit XML.
    row = next(ln for ln in summary.splitlines() if ln.startswith("| pytest_multi_gpu.xml"))
    passed, failed, _ = (int(c) for c in row.strip(" |").split("|")[1:4])
    assert passed >= 2 and failed == 0, summary


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gpu_check_past_its_budget_skips_steps_and_still_writes_the_summary(tmp_path):
    proc, out = _run(tmp_path, 100, GPU_CHECK_BUDGET_S="5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _assert_fits_the_device_tool(out)
    steps = (out / "steps.txt").read_text().splitlines()
    assert steps and all(line.endswith("rc=budget") for line in steps), steps
    assert any(line.startswith("serve P/D") for line in steps), steps
    summary = (out / "summary.md").read_text()
    assert "steps not ok: " in summary and "rc=budget" in summary, summary
    assert "rc=budget" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_check_runs_only_the_steps_named_and_without_llguidance_skips_structured(tmp_path):
    # GPU_CHECK_ONLY: the preflight, the steps named and the model they need; nothing else.
    # The GPU host may lack llguidance (not in every wheel set): its step is skipped and
    # says why; the preflight and the other steps are unaffected. (One run checks both:
    # each started the script, built the model and ran the latency step.)
    fake = tmp_path / "no_llguidance" / "llguidance"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    path = os.pathsep.join(p for p in (str(fake.parent), os.environ.get("PYTHONPATH")) if p)
    proc, out = _run(tmp_path, 280, GPU_CHECK_ONLY="structured latency", PYTHONPATH=path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = (out / "steps.txt").read_text().splitlines()
    # The preflight, the steps named and the model they need, in order; nothing else.
    assert steps == [
        "preflight imports rc=0",
        "make-model tiny-llama rc=0",
        "offline latency rc=0",
        "offline structured json rc=skipped",
    ], steps
    summary = (out / "summary.md").read_text()
    row = next(ln for ln in summary.splitlines() if "structured JSON" in ln)
    assert "skipped: llguidance not importable (ImportError: hidden by the test)" in row, row
    assert "steps not ok: none" in summary and "steps skipped: offline structured" in summary
