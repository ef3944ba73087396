"""A property test whose example counts a ``PDSERVE_*_EXAMPLES`` hunt multiplies has its
pytest-timeout multiplied too (``fakes.hunt_timeout``): a fixed limit fires inside an
example of a long hunt, a failure to hypothesis, whose replay of the cut example then
fails with FlakyStrategyDefinition instead of naming a bug."""

from __future__ import annotations

import ast
import pathlib

import pytest

TESTS = pathlib.Path(__file__).parent


def _scaled_modules() -> list[pathlib.Path]:
    return [
        p
        for p in sorted(TESTS.glob("test_property_*.py"))
        if "hypothesis" in p.read_text() and "_EXAMPLES" in p.read_text()
    ]


def _calls(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(n, ast.Call)
        and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)
        for n in ast.walk(node)
    )


def _is_given(decorator: ast.expr) -> bool:
    func = decorator.func if isinstance(decorator, ast.Call) else decorator
    return getattr(func, "id", None) == "given" or getattr(func, "attr", None) == "given"


def test_the_hunts_are_found() -> None:
    names = {p.name for p in _scaled_modules()}
    assert {"test_property_engine.py", "test_property_pd_protocol.py"} <= names, names


@pytest.mark.parametrize("path", _scaled_modules(), ids=lambda p: p.name)
def test_every_scaled_property_test_scales_its_timeout(path: pathlib.Path) -> None:
    tree = ast.parse(path.read_text())
    module_wide = any(
        isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
        and _calls(n.value, "hunt_timeout")
        for n in tree.body
    )
    unscaled = [
        f.name
        for f in tree.body
        if isinstance(f, ast.FunctionDef)
        and any(_is_given(d) for d in f.decorator_list)
        and not (module_wide or any(_calls(d, "hunt_timeout") for d in f.decorator_list))
    ]
    assert not unscaled, f"{path.name}: no hunt_timeout on {unscaled}"
    # One formula: no timeout marker of its own.
    fixed = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr == "timeout"
        and getattr(n.value, "attr", None) == "mark"
    ]  # fmt: skip
    assert not fixed, f"{path.name}: pytest.mark.timeout at lines {fixed}"


def test_hunt_timeout_and_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    from fakes import example_scale, hunt_timeout

    monkeypatch.delenv("PDSERVE_X_EXAMPLES", raising=False)
    assert example_scale("PDSERVE_X_EXAMPLES") == 1
    monkeypatch.setenv("PDSERVE_X_EXAMPLES", "8")
    assert example_scale("PDSERVE_X_EXAMPLES") == 8
    monkeypatch.setenv("PDSERVE_X_EXAMPLES", "0")
    assert example_scale("PDSERVE_X_EXAMPLES") == 1
    mark = hunt_timeout(8)
    assert mark.name == "timeout" and mark.args == (300 * 8,)
    assert hunt_timeout(3, 1200).args == (3600,)
