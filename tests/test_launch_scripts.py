"""scripts/launch_{prefill,decode,proxy}.sh: one process per call, printing where it listens
and how to stop it; together they make a working deployment."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from harness import descendants, free_port, metric, wait_gone

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def launch(script: str, tmp: Path, *args: str, **extra_env: str) -> tuple[str, int]:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "LOG_DIR": str(tmp / "logs"),
        "RUN_DIR": str(tmp / "run"),
        **extra_env,
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pid = int(re.search(r"stop: kill (\d+)", proc.stdout).group(1))
    return proc.stdout, pid


def test_launch_scripts_bring_up_a_deployment(tmp_path: Path):
    pids: list[int] = []
    kids: list[int] = []
    try:
        p_port, d_port, x_port = free_port(), free_port(), free_port()
        # The nodes' key given after -- (not in the environment): the script still reads
        # the side channel it prints from the keyed /v1/kv_transfer_info.
        key = ("--", "--api-key", "node-secret")
        out, pid = launch(
            "launch_prefill.sh", tmp_path, "--host", "127.0.0.1", "--port", str(p_port), *key
        )
        pids.append(pid)
        assert f"prefill node listening on http://127.0.0.1:{p_port}" in out
        assert "KV side channel: tcp://127.0.0.1:" in out
        out, pid = launch(
            "launch_decode.sh", tmp_path, "--host", "127.0.0.1", "--port", str(d_port), *key
        )
        pids.append(pid)
        assert f"decode node listening on http://127.0.0.1:{d_port}" in out
        assert "KV side channel: tcp://127.0.0.1:" in out
        out, pid = launch(
            "launch_proxy.sh",
            tmp_path,
            "--host", "127.0.0.1", "--port", str(x_port),
            "--prefill", f"http://127.0.0.1:{p_port}",
            "--decode", f"http://127.0.0.1:{d_port}",
            "--", "--node-api-key", "node-secret",
        )  # fmt: skip
        pids.append(pid)
        assert "ready: yes" in out
        resp = httpx.post(
            f"http://127.0.0.1:{x_port}/v1/completions",
            json={"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"][0]["token_ids"]) == 6
        assert metric(f"http://127.0.0.1:{p_port}", "pdserve_engine_kv_bytes_sent_total") > 0
        for pid in pids:
            kids += descendants(pid)
    finally:
        # Also what a script started before it failed: its pid file is in RUN_DIR.
        for pidfile in (tmp_path / "run").glob("*.pid"):
            pid = int(pidfile.read_text())
            if pid not in pids:
                pids.append(pid)
                kids += descendants(pid)
        for pid in pids:  # "stop: kill <pid>", as the scripts print
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    assert wait_gone(pids + kids, 60) == []


def test_launch_proxy_without_node_lists_when_nodes_register(tmp_path: Path):
    """docs/proxy.md: each role needs --prefill/--decode, its --*-dns, or
    --registration-key (and no prefill node at all with --prefill-fallback). The script
    refused all but the lists ("--prefill (or PREFILL_URLS) is required", exit 2) before
    starting the proxy that would have taken them (a walkthrough of the registration docs)."""
    port = free_port()
    out, pid = launch(
        "launch_proxy.sh", tmp_path, "--host", "127.0.0.1", "--port", str(port),
        "--", "--registration-key", "reg-key", STARTUP_TIMEOUT="2",
    )  # fmt: skip
    try:
        assert "ready: no" in out  # no node has registered yet
        assert "prefill: -" in out and "decode:  -" in out
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/nodes/register",
            json={"role": "decode", "url": "http://127.0.0.1:1"},
            headers={"Authorization": "Bearer reg-key"},
            timeout=10,
        )
        assert resp.status_code == 200, resp.text
    finally:
        os.kill(pid, signal.SIGTERM)
    assert wait_gone([pid], 30) == []
