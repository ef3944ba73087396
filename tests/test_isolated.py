"""``@pytest.mark.isolated`` (``tests/isolated.py``): a test that segfaults, aborts at
exit or hangs in a child pytest process fails that one test and the run goes on; pass,
fail and skip come back as the child reported them; module fixtures of the tests around
an isolated one are set up and torn down as usual. A pytest run of a generated module,
with toy tests (no torch), in a temporary directory."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts pytest processes

TESTS_DIR = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS_DIR)!r})
import isolated

def pytest_configure(config):
    config.pluginmanager.register(isolated, "pdserve-isolated")
"""

INI = """
[pytest]
addopts = -p no:cacheprovider --strict-markers
timeout = 2
markers =
    isolated: runs in a child pytest process
"""

TEST_A = """
import atexit
import ctypes
import os
import time

import pytest

LOG = os.path.join(os.path.dirname(__file__), "fixture.log")
WHERE = "child" if os.environ.get("PDSERVE_TEST_ISOLATED_CHILD") else "parent"


@pytest.fixture(scope="module")
def shared():
    with open(LOG, "a") as f:
        f.write(f"up {WHERE}\\n")
    yield
    with open(LOG, "a") as f:
        f.write(f"down {WHERE}\\n")


def test_before(shared):
    pass


@pytest.mark.isolated
def test_passes(shared):
    print("child output")


@pytest.mark.isolated
def test_fails():
    assert 1 + 1 == 3, "the child's assertion"


@pytest.mark.isolated
def test_skips():
    pytest.skip("the child's reason")


@pytest.mark.isolated
def test_segfaults():
    ctypes.string_at(0)  # SIGSEGV in native code


@pytest.mark.isolated
def test_aborts_at_exit():
    atexit.register(os.abort)


@pytest.mark.isolated(allowance_s=4)  # killed 6 s after it started, however slow that is
def test_hangs_at_exit():
    atexit.register(time.sleep, 120)


@pytest.mark.isolated
def test_after(shared):
    assert os.environ["PDSERVE_TEST_ISOLATED_CHILD"]
"""

TEST_B = """
import os

LOG = os.path.join(os.path.dirname(__file__), "fixture.log")


def test_next_module():
    with open(LOG, "a") as f:
        f.write("next module\\n")
"""


TEST_BATCH = """
import atexit
import ctypes
import os

import pytest

pytestmark = pytest.mark.isolated(batch=True)
LOG = os.path.join(os.path.dirname(__file__), "batch.log")


def log(what):
    with open(LOG, "a") as f:
        f.write(f"{what} {os.getpid()}\\n")


@pytest.fixture(scope="module")
def shared():
    log("up")
    yield
    log("down")


def test_batch_one(shared):
    log("one")


def test_batch_two(shared):
    log("two")


def test_batch_segfaults(shared):
    log("segfaults")
    ctypes.string_at(0)


def test_batch_three(shared):
    log("three")


def test_batch_aborts_at_exit(shared):
    log("aborts")
    atexit.register(os.abort)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, tuple[str, str]], Path]:
    """One pytest run over test_a.py (isolated tests, one child each), test_batch.py
    (``isolated(batch=True)``) and test_b.py: its output, each test's (outcome, text)
    from the junit XML, and its directory."""
    tmp_path = tmp_path_factory.mktemp("isolated")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_a.py").write_text(TEST_A)
    (tmp_path / "test_batch.py").write_text(TEST_BATCH)
    (tmp_path / "test_b.py").write_text(TEST_B)
    junit = tmp_path / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "--junitxml", str(junit), "--rootdir", "."]
        + ["-c", "pytest.ini", "test_a.py", "test_batch.py", "test_b.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        # The others get the default allowance: a child slow to start under load still
        # passes (4 s was too short for test_passes on CI's loaded cores).
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # tests failed; the run itself completed
    assert "INTERNALERROR" not in out and "not torn down" not in out, out
    results: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = [(c.tag, (c.get("message") or "") + (c.text or "")) for c in case]
        kinds = [k for k in kinds if k[0] in ("failure", "error", "skipped")]
        results[case.get("name")] = kinds[0] if kinds else ("passed", "")
    return out, results, tmp_path


def test_crashes_fail_one_test_and_the_run_goes_on(run) -> None:
    out, results, tmp_path = run
    assert {
        "test_before",
        "test_passes",
        "test_fails",
        "test_skips",
        "test_segfaults",
        "test_aborts_at_exit",
        "test_hangs_at_exit",
        "test_after",
        "test_next_module",
    } <= results.keys(), out
    for name in ("test_before", "test_passes", "test_after", "test_next_module"):
        assert results[name][0] == "passed", (name, results[name], out)
    assert results["test_fails"][0] == "failure"
    assert "the child's assertion" in results["test_fails"][1]
    kind, text = results["test_skips"]
    line = next(i for i, t in enumerate(TEST_A.split("\n"), 1) if "pytest.skip(" in t)
    assert kind == "skipped" and text.endswith(f"test_a.py:{line}: the child's reason"), out
    kind, text = results["test_segfaults"]
    assert kind == "failure" and "was killed by SIGSEGV during call" in text, out
    assert "Fatal Python error: Segmentation fault" in text  # faulthandler, in the tail
    kind, text = results["test_aborts_at_exit"]
    assert kind == "error" and "was killed by SIGABRT after the test had finished" in text
    kind, text = results["test_hangs_at_exit"]
    assert kind == "error" and "did not finish within 6 s (killed)" in text, out

    # The module fixture: once in this process for test_before, torn down before the next
    # module's test; once in each isolated child that used it.
    log = (tmp_path / "fixture.log").read_text().splitlines()
    assert log.count("up parent") == 1 and log.count("down parent") == 1, log
    assert log.index("up parent") < log.index("down parent") < log.index("next module"), log
    assert log.count("up child") == log.count("down child") == 2, log


def test_a_batch_shares_a_child_until_a_crash_and_a_new_child_takes_the_rest(run) -> None:
    out, results, tmp_path = run
    for name in ("test_batch_one", "test_batch_two", "test_batch_three"):
        assert results[name][0] == "passed", (name, results[name], out)
    kind, text = results["test_batch_segfaults"]
    assert kind == "failure" and "was killed by SIGSEGV during call" in text, out
    kind, text = results["test_batch_aborts_at_exit"]
    assert kind == "error", out
    assert "was killed by SIGABRT after its 2 tests had finished (this one the last)" in text

    # Two children: one ran the tests up to the crash, the other the rest; the module
    # fixture once in each (the crashed one never tore it down).
    pids = {}
    for line in (tmp_path / "batch.log").read_text().splitlines():
        what, pid = line.split()
        pids.setdefault(what, []).append(pid)
    first, second = pids["one"][0], pids["three"][0]
    assert first != second, pids
    assert pids["two"] == pids["segfaults"] == [first], pids
    assert pids["up"] == [first, second] and pids["aborts"] == [second], pids
    assert pids["down"] == [second], pids
