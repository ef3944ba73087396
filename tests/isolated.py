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

``@pytest.mark.isolated(batch=True)``: the tests of one module so marked that run one
after the other share one child (a module-scoped fixture is set up once for them). A
crash fails the test it happened in and a new child takes the tests after it; a crash
at the child's exit, after its last test, fails that last test. Each test's limit counts
from the end of the one before it. Batches form where this process runs a module's
tests together (no xdist, or ``--dist loadfile``/``loadscope``); elsewhere each test
gets its own child.

Costs: one interpreter start and one collection of the test's module per child (~3-4 s
on 2 cores). Fixtures of every scope are set up in the child only, so a module-scoped
fixture of an isolated test is set up once per child. ``conftest.py`` registers this
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


def _child_command(items: list[pytest.Item]) -> list[str]:
    config = items[0].config
    cmd = [sys.executable, "-m", "pytest", *(i.nodeid for i in items), "-q"]
    cmd += ["-p", "no:cacheprovider"]
    # Plugins the tests do not use: hypothesis's is seconds of CPU to import on 2 cores
    # (xdist's: the child runs its tests in itself).
    cmd += ["-p", "no:xdist"]
    if not any(getattr(getattr(i, "obj", None), "is_hypothesis_test", False) for i in items):
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


def _load_report(config: pytest.Config, line: str) -> pytest.TestReport | None:
    try:
        data = json.loads(line)
    except json.JSONDecodeError:
        return None  # a line cut short by the crash
    # JSON has no tuples: give back the ones pytest's reporters unpack.
    data["location"] = tuple(data["location"])
    if isinstance(data.get("longrepr"), list):
        data["longrepr"] = tuple(data["longrepr"])
    data["user_properties"] = [tuple(p) for p in data.get("user_properties", [])]
    data["sections"] = [tuple(s) for s in data.get("sections", [])]
    return config.hook.pytest_report_from_serializable(config=config, data=data)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _batch_of(item: pytest.Item) -> list[pytest.Item]:
    """``item`` and, when it is marked ``isolated(batch=True)``, the tests right after it
    in the run that are too and come from the same module: one child runs them in turn.
    Only where this process runs a module's tests together (no xdist, or xdist handing
    out whole files or scopes)."""
    if not item.get_closest_marker(MARKER).kwargs.get("batch"):
        return [item]
    if getattr(item.config.option, "dist", "no") not in ("no", "loadfile", "loadscope"):
        return [item]
    items = item.session.items
    try:
        at = items.index(item)
    except ValueError:
        return [item]
    batch = [item]
    for nxt in items[at + 1 :]:
        mark = nxt.get_closest_marker(MARKER)
        if nxt.path != item.path or mark is None or not mark.kwargs.get("batch"):
            break
        batch.append(nxt)
    return batch


class _Child:
    """One child pytest process running ``items`` in turn, its reports read as they
    come. Each test has its limit (timeout and allowance) from when the one before it
    finished (the first: from the child's start)."""

    def __init__(self, items: list[pytest.Item]) -> None:
        self.items = items  # what it has left to run
        self.count = len(items)
        self.config = items[0].config
        self.cmd = _child_command(items)
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-isolated-")
        tmp = Path(self._tmp.name)
        self.report_path = tmp / "reports.jsonl"
        self.out_path = tmp / "output.txt"
        self._read_at = 0
        self.reports: dict[str, list[pytest.TestReport]] = {}
        env = {**os.environ, CHILD_ENV: str(self.report_path)}
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                [*self.cmd, "--basetemp", str(tmp / "basetemp")],
                cwd=self.config.rootpath,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed whole if it dies
            )
        self.since = time.monotonic()  # the current test's limit counts from here

    def _read(self) -> None:
        if not self.report_path.exists():
            return
        with open(self.report_path, encoding="utf-8") as f:
            f.seek(self._read_at)
            chunk = f.read()
        # Whole lines only: the child may be writing the next one.
        whole = chunk[: chunk.rfind("\n") + 1]
        self._read_at += len(whole.encode("utf-8"))
        for line in whole.splitlines():
            report = _load_report(self.config, line)
            if report is not None:
                self.reports.setdefault(report.nodeid, []).append(report)

    def _done(self, item: pytest.Item) -> bool:
        return any(r.when == "teardown" for r in self.reports.get(item.nodeid, ()))

    def close(self) -> None:
        if self.proc.poll() is None:
            _kill_group(self.proc.pid)
            self.proc.wait()
        self._tmp.cleanup()

    def run(self, item: pytest.Item) -> tuple[list[pytest.TestReport], bool]:
        """``item``'s reports (a failed one for the phase the child died or hung in) and
        whether the child can go on with the next test."""
        timeout = item.stash.get(_LIMIT, 0.0)
        allowance = item.stash.get(_ALLOWANCE, STARTUP_ALLOWANCE_S)
        limit = timeout + allowance if timeout > 0 else NO_TIMEOUT_S
        last = item is self.items[-1]
        hung = False
        while True:
            self._read()
            if self._done(item) and not last:
                break
            if self.proc.poll() is not None:
                self._read()
                break
            if time.monotonic() - self.since > limit:
                hung = True
                _kill_group(self.proc.pid)
                self.proc.wait()
                break
            time.sleep(0.02)
        took = time.monotonic() - self.since
        self.since = time.monotonic()
        reports = self.reports.pop(item.nodeid, [])
        done = {r.when for r in reports}
        complete = {"setup", "teardown"} <= done
        if complete and not last:
            return reports, True  # whatever the child does next is the next test's
        code = self.proc.poll()
        crashed = hung or code not in _PYTEST_CODES
        if crashed:
            _kill_group(self.proc.pid)  # what it left running (its own children, same group)
        if complete and not crashed:
            return reports, False
        if hung:
            what = f"did not finish within {limit:.0f} s (killed)"
        else:
            what = _describe_exit(self.proc.returncode)
        phase = next((w for w in ("setup", "call", "teardown") if w not in done), None)
        if phase == "call" and any(r.when == "setup" and not r.passed for r in reports):
            phase = "teardown"  # a setup that failed or skipped has no call
        tail = self.out_path.read_text(encoding="utf-8", errors="replace")[-OUTPUT_TAIL:]
        where = f"during {phase}" if phase else "after the test had finished"
        if phase is None and self.count > 1:
            where = f"after its {self.count} tests had finished (this one the last)"
        text = (
            f"isolated test: its child pytest process (pid {self.proc.pid}) {what} {where}.\n"
            f"command: {' '.join(self.cmd)}\n"
            f"--- the last {OUTPUT_TAIL} characters of its output ---\n{tail}"
        )
        # The failure takes the phase the child died in (or the teardown's place, when it
        # died after reporting it); every test still gets one teardown report.
        reports = [r for r in reports if r.when != "teardown"]
        reports.append(_report(item, phase or "teardown", "failed", text, took))
        if phase in ("setup", "call"):
            reports.append(_report(item, "teardown", "passed", None, 0.0))
        return reports, False


_PYTEST_CODES = (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
_CHILD = pytest.StashKey[_Child]()


def _run_child(item: pytest.Item) -> list[pytest.TestReport]:
    """``item``'s reports from the child running it: the live child whose batch holds it,
    or a new one for it (and the batch it starts)."""
    stash = item.session.stash
    child = stash.get(_CHILD, None)
    if child is not None and child.items[0] is not item:
        child.close()  # its remaining tests are not run here (-x, a deselection)
        child = None
    if child is None:
        child = _Child(_batch_of(item))
        stash[_CHILD] = child
    try:
        reports, go_on = child.run(item)
    except BaseException:
        child.close()
        del stash[_CHILD]
        raise
    if not go_on:
        child.close()
        del stash[_CHILD]
    else:
        child.items = child.items[1:]  # items[0] was this one
    return reports


def pytest_sessionfinish(session: pytest.Session) -> None:
    child = session.stash.get(_CHILD, None)
    if child is not None:
        child.close()
        del session.stash[_CHILD]


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
