"""Every script's --help prints its header comment as text and exits 0, doing nothing else:
no `#` prefixes, no shell code after the header, no downloads, no files written."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [
    "run_loopback.sh",
    "launch_prefill.sh",
    "launch_decode.sh",
    "launch_proxy.sh",
    "gpu_check.sh",
    "fetch_gpu_wheels.sh",
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_the_header_and_does_nothing_else(script: str, tmp_path: Path):
    # A copy of scripts/ in an empty tree: a script that ignored --help would write there
    # (fetch_gpu_wheels.sh: .whl/, .git/info/exclude), not in the checkout.
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    out, work = tmp_path / "out", tmp_path / "work"
    env = {
        "PATH": "/usr/bin:/bin",
        "OUT": str(out),
        "GPU_CHECK_WORK": str(work),
        "LOG_DIR": str(tmp_path / "logs"),
        "RUN_DIR": str(tmp_path / "run"),
        "PIP_NO_INDEX": "1",
    }
    proc = subprocess.run(
        ["bash", str(repo / "scripts" / script), "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) >= 3, proc.stdout
    assert not any(line.startswith("#") for line in lines), proc.stdout
    assert "set -" not in proc.stdout and "pipefail" not in proc.stdout, proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]
    assert sorted(p.name for p in repo.iterdir()) == ["scripts"]
