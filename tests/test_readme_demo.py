"""The README's first command: its demo brings up P + D + proxy and prints a streamed completion."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_first_two_commands_are_install_demo_and_tests():
    first, second = readme_commands()[:2]
    assert "pip install" in first and "scripts/run_loopback.sh" in first
    assert second.startswith("python -m pytest -q")
    # CI runs the README's test command, word for word.
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert second in ci, ci


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_loopback_demo_streams_through_the_proxy_and_cleans_up():
    proc = subprocess.run(
        ["bash", "scripts/run_loopback.sh", "--max-tokens", "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "streamed completion through the proxy" in out
    assert re.search(r"pdserve_engine_kv_bytes_sent_total [1-9]", out), out
    # Everything it started is gone: nothing answers on the URLs it printed.
    urls = re.findall(r"http://127\.0\.0\.1:\d+", out)
    assert len(urls) == 3, out
    for url in urls:
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)
