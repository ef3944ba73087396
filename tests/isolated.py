"""``@pytest.mark.isolated``: run a test in a child pytest process, so that a crash in
native code (a segfault in ``ucxx``: its endpoint close was seen to crash once) fails
that one test instead of taking the whole run down.

The pytest process does not run an isolated test itself: it starts
``python -m pytest <the test's node id>`` (same interpreter, same rootdir and ini file,
its environment plus ``PDSERVE_TEST_ISOLATED_CHILD``), and reports what the child
reported -- setup, call and teardown, each with its outcome, traceback and captured
output, as if the test had run here. A child that dies (a signal, an exit status other
than pytest's own) or outlives the test's timeout by ``STARTUP_ALLOWANCE_S`` (or the
marker's ``allowance_s``: ``@pytest.mark.isolated(allowance_s=4)``) fails the phase it was in, with its exit status
or signal and the tail of its output; its process group (the test's own child
processes) is killed. The run goes on with the next test.

Costs: one interpreter start and one collection of the test's module per test (~3-4 s
on 2 cores). Fixtures of every scope are set up in the child only, so a module-scoped
fixture of an isolated test is set up once per test. ``conftest.py`` registers this
module as a plugin; inside the child its hooks do nothing but record the reports, and
the test runs as usual.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

MARKER = "isolated"
CHILD_ENV = "PDSERVE_TEST_ISOLATED_CHILD"  # set in the child: the file its reports go to
STARTUP_ALLOWANCE_S = 120.0  # on top of the test's timeout (start, collection, teardown)
NO_TIMEOUT_S = 1800.0  # the child's limit when the test has no timeout
OUTPUT_TAIL = 6000

_LIMIT = pytest.StashKey[float]()
_ALLOWANCE = pytest.StashKey[float]()


def in_child() -> bool:
    return bool(os.environ.get(CHILD_ENV))


class _ChildReporter:
    """In the child: every test report, as pytest serialises it (what pytest-xdist
    sends), one JSON line each, flushed at once so a crash keeps what came before."""

    def __init__(self, config: pytest.Config, path: str) -> None:
        self.config = config
        self.path = path

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(data, default=str) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get(CHILD_ENV)
    if path:
        config.pluginmanager.register(_ChildReporter(config, path), "pdserve-isolated-child")


def _timeout_s(item: pytest.Item) -> float:
    """The test's pytest-timeout limit (marker, ``--timeout``, ini), 0 for none."""
    mark = item.get_closest_marker("timeout")
    if mark is not None:
        value = mark.args[0] if mark.args else mark.kwargs.get("timeout")
        return float(value or 0)
    with contextlib.suppress(ValueError, TypeError):
        value = item.config.getoption("timeout", None)
        if value is None:
            value = item.config.getini("timeout")
        return float(value or 0)
    return 0.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In the pytest process: take each isolated test's timeout for its child, and turn
    pytest-timeout off for it here (the child enforces it; a timer firing in this process
    while it waits for the child would end the run)."""
    if in_child():
        return
    timeouts = config.pluginmanager.hasplugin("timeout")
    for item in items:
        if item.get_closest_marker(MARKER) is None:
            continue
        item.stash[_LIMIT] = _timeout_s(item)
        mark = item.get_closest_marker(MARKER)
        item.stash[_ALLOWANCE] = float(mark.kwargs.get("allowance_s", STARTUP_ALLOWANCE_S))
        if timeouts:
            item.add_marker(pytest.mark.timeout(0), append=False)


def _child_command(item: pytest.Item) -> list[str]:
    config = item.config
    cmd = [sys.executable, "-m", "pytest", item.nodeid, "-q", "-p", "no:cacheprovider"]
    # Plugins the one test does not use: hypothesis's is seconds of CPU to import on 2
    # cores (xdist's: the child runs one test, in itself).
    cmd += ["-p", "no:xdist"]
    if not getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
        cmd += ["-p", "no:hypothesispytest"]
    cmd += ["--rootdir", str(config.rootpath)]
    if config.inipath is not None:
        cmd += ["-c", str(config.inipath)]
    cli_timeout = None
    with contextlib.suppress(ValueError):
        cli_timeout = config.getoption("timeout", None)
    if cli_timeout is not None:
        cmd += ["--timeout", str(cli_timeout)]
    return cmd


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def _report(
    item: pytest.Item, when: str, outcome: str, text: str | None, duration: float
) -> pytest.TestReport:
    now = time.time()
    return pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords={k: 1 for k in item.keywords},
        outcome=outcome,  # type: ignore[arg-type]
        longrepr=text,
        when=when,
        duration=duration,
        start=now - duration,
        stop=now,
    )


def _load_reports(config: pytest.Config, path: Path) -> list[pytest.TestReport]:
    reports = []
    if not path.exists():
        return reports
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the crash
        # JSON has no tuples: give back the ones pytest's reporters unpack.
        data["location"] = tuple(data["location"])
        if isinstance(data.get("longrepr"), list):
            data["longrepr"] = tuple(data["longrepr"])
        data["user_properties"] = [tuple(p) for p in data.get("user_properties", [])]
        data["sections"] = [tuple(s) for s in data.get("sections", [])]
        reports.append(config.hook.pytest_report_from_serializable(config=config, data=data))
    return reports


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _run_child(item: pytest.Item) -> list[pytest.TestReport]:
    """The child's reports for ``item``; a failed report for the phase it died in, if it
    died or hung; a failed teardown report if it died after the test."""
    timeout = item.stash.get(_LIMIT, 0.0)
    allowance = item.stash.get(_ALLOWANCE, STARTUP_ALLOWANCE_S)
    limit = timeout + allowance if timeout > 0 else NO_TIMEOUT_S
    cmd = _child_command(item)
    with tempfile.TemporaryDirectory(prefix="pdserve-isolated-") as tmp:
        report_path = Path(tmp) / "reports.jsonl"
        out_path = Path(tmp) / "output.txt"
        env = {**os.environ, CHILD_ENV: str(report_path)}
        t0 = time.monotonic()
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                [*cmd, "--basetemp", str(Path(tmp) / "basetemp")],
                cwd=item.config.rootpath,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed whole if it dies
            )
            hung = False
            try:
                proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                hung = True
            finally:
                if proc.poll() is None:  # hung, or this process was interrupted
                    _kill_group(proc.pid)
                    proc.wait()
        took = time.monotonic() - t0
        code = proc.returncode
        reports = [r for r in _load_reports(item.config, report_path) if r.nodeid == item.nodeid]
        crashed = hung or code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
        if crashed:
            _kill_group(proc.pid)  # what it left running (its own children, same group)
        done = {r.when for r in reports}
        if not crashed and {"setup", "teardown"} <= done:
            return reports
        what = f"did not finish within {limit:.0f} s (killed)" if hung else _describe_exit(code)
        phase = next((w for w in ("setup", "call", "teardown") if w not in done), None)
        if phase == "call" and any(r.when == "setup" and not r.passed for r in reports):
            phase = "teardown"  # a setup that failed or skipped has no call
        tail = out_path.read_text(encoding="utf-8", errors="replace")[-OUTPUT_TAIL:]
        where = f"during {phase}" if phase else "after the test had finished"
        text = (
            f"isolated test: its child pytest process (pid {proc.pid}) {what} {where}.\n"
            f"command: {' '.join(cmd)}\n"
            f"--- the last {OUTPUT_TAIL} characters of its output ---\n{tail}"
        )
        # The failure takes the phase the child died in (or the teardown's place, when it
        # died after reporting it); every test still gets one teardown report.
        reports = [r for r in reports if r.when != "teardown"]
        reports.append(_report(item, phase or "teardown", "failed", text, took))
        if phase in ("setup", "call"):
            reports.append(_report(item, "teardown", "passed", None, 0.0))
        return reports


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """Isolated tests run here (None: not one, run it as usual)."""
    if in_child() or item.get_closest_marker(MARKER) is None:
        return None
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = _run_child(item)
    for rep in reports:
        if rep.when != "teardown":
            ihook.pytest_runtest_logreport(report=rep)
    # This process set nothing up for the test, but fixtures of earlier tests (a module's,
    # the session's) that the next test does not need end here, as after any test.
    if item.session.shouldfail or item.session.shouldstop:
        nextitem = None
    call = pytest.CallInfo.from_call(
        lambda: item.session._setupstate.teardown_exact(nextitem), when="teardown"
    )
    for rep in reports:
        if rep.when == "teardown":
            ihook.pytest_runtest_logreport(report=rep)
    if call.excinfo is not None:
        ihook.pytest_runtest_logreport(report=pytest.TestReport.from_item_and_call(item, call))
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
