"""Every repository path the docs name exists ("docs/architecture.md stays true as the code
moves"): each ``something.py`` / ``.sh`` / ``.md`` / ... named in ``README.md`` and
``docs/*.md`` is a file of the repository, and each ``tests/x.py::name`` names a test of that
file. A path may be written relative to the package its section is about (the file map's
``server/app.py`` is ``engine/server/app.py``): it counts when a repository file ends with
it. Files the reader creates or gets elsewhere are in ``ALLOWED``, with the reason. And the
file map of ``docs/architecture.md`` names every module (a new module gets its line; a
module named only by a file name another module shares passes unnoticed)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(
    r"(?<![\w./$-])((?:[\w.-]+/)*[\w-][\w.-]*\.(?:py|sh|md|toml|yaml|yml|json|txt|cfg))\b"
)
TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
BARE_TEST = re.compile(r"`(test_\w+\*?)`")
# the file map's packages ("Packages and modules": every module in one line)
MAPPED = (
    "engine/",
    "kvconnector/",
    "proxy/",
    "prefill_node/",
    "decode_node/",
    "scripts/",
    "tests/",
)
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".pytest_cache"}

ALLOWED = {
    # a Hugging Face checkpoint's files (the reader's model directory)
    "config.json": "a checkpoint's file",
    "generation_config.json": "a checkpoint's file",
    "tokenizer.json": "a checkpoint's file",
    "tokenizer_config.json": "a checkpoint's file",
    "chat_template.json": "a checkpoint's file",
    # files a reader writes, or a command writes for them
    "node.yaml": "the reader's --config file (README example)",
    "serve.json": "pd-bench serve --json output (example command)",
    "transfer.json": "pd-bench transfer --json output (example command)",
    "interference.json": "pd-bench interference --json output (example command)",
    "i.json": "pd-bench interference --json output (example command)",
    "run.json": "pd-bench serve --json output (example command)",
    "summary.md": "scripts/gpu_check.sh's output in $OUT",
    "steps.txt": "scripts/gpu_check.sh's output in $OUT",
    "gpu-rdma/kustomization.yaml": "a Kustomize overlay the reader writes (docs/deploy.md)",
    "gpu-rdma/gpu-rdma.yaml": "a Kustomize overlay the reader writes (docs/deploy.md)",
    "gpu-rdma.yaml": "a Kustomize overlay the reader writes (docs/deploy.md)",
    # other projects' files
    "vllm/v1/engine/detokenizer.py": "vLLM's source, cited",
    "vllm/v1/metrics/stats.py": "vLLM's source, cited",
}
# tests named by a former name on purpose (the doc says what they became)
ALLOWED_TESTS = {
    "tests/test_drain.py::test_a_plain_answer_not_started_at_the_shutdown_timeout_is_a_503_draining",
}


def repo_files() -> list[str]:
    """The repository's files: git's (tracked, and untracked ones git does not ignore)
    in a checkout, else every file under the root but caches."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, text=True, check=True, timeout=30,
        ).stdout.split("\n")  # fmt: skip
        return [f for f in listed if f and (ROOT / f).exists()]
    except (OSError, subprocess.SubprocessError):
        pass
    out = []
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        rel = Path(top).relative_to(ROOT)
        out += [(rel / n).as_posix() for n in names]
    return out


def missing_paths(text: str, files: list[str]) -> list[str]:
    """Paths named in ``text`` that no repository file is, or ends with."""
    names = set(files)
    bad = []
    for m in PATH.finditer(text):
        path = m.group(1)
        if path in ALLOWED or path in names:
            continue
        if not any(f.endswith("/" + path) for f in files):
            bad.append(path)
    return bad


def missing_tests(text: str) -> list[str]:
    bad = []
    for m in TEST.finditer(text):
        path, name = m.groups()
        if f"{path}::{name}" in ALLOWED_TESTS:
            continue
        src = ROOT / path
        if not src.is_file() or not re.search(
            rf"^\s*(?:async )?(?:def|class) {name}\b", src.read_text(encoding="utf-8"), re.M
        ):
            bad.append(f"{path}::{name}")
    return bad


def missing_bare_tests(text: str, tests: set[str], modules: set[str]) -> list[str]:
    """Backticked ``test_x`` names that are neither a test nor a test module (``test_x*``:
    a prefix of some test's name)."""
    bad = []
    for m in BARE_TEST.finditer(text):
        name = m.group(1)
        if name.endswith("*"):
            if not any(t.startswith(name[:-1]) for t in tests):
                bad.append(name)
        elif name not in tests and name not in modules:
            bad.append(name)
    return bad


def test_every_path_the_docs_name_exists() -> None:
    files = repo_files()
    bad = {
        doc.relative_to(ROOT).as_posix(): missing
        for doc in DOCS
        if (missing := missing_paths(doc.read_text(encoding="utf-8"), files))
    }
    assert not bad, f"paths named in the docs that are not in the repository: {bad}"


def test_every_test_the_docs_name_exists() -> None:
    bad = {
        doc.relative_to(ROOT).as_posix(): missing
        for doc in DOCS
        if (missing := missing_tests(doc.read_text(encoding="utf-8")))
    }
    assert not bad, f"tests named in the docs that are not in their files: {bad}"


def test_every_test_named_alone_exists() -> None:
    tests: set[str] = set()
    modules: set[str] = set()
    for p in (ROOT / "tests").rglob("test_*.py"):
        modules.add(p.stem)
        tests.update(
            re.findall(r"^\s*(?:async )?def (test_\w+)", p.read_text(encoding="utf-8"), re.M)
        )
    bad = {
        doc.relative_to(ROOT).as_posix(): missing
        for doc in DOCS
        if (missing := missing_bare_tests(doc.read_text(encoding="utf-8"), tests, modules))
    }
    assert not bad, f"tests named in the docs that no test file has: {bad}"


def unmapped_modules(text: str, files: list[str]) -> list[str]:
    """Modules of the packages, scripts and test helpers that the file map does not name
    (by a path it ends with)."""
    named = {m.group(1) for m in PATH.finditer(text)}
    code = [
        f
        for f in files
        if f.startswith(MAPPED)
        and f.endswith((".py", ".sh"))
        and not f.endswith("__init__.py")
        and not f.rsplit("/", 1)[-1].startswith("test_")
    ]
    return [f for f in code if not any(f == n or f.endswith("/" + n) for n in named)]


def test_the_file_map_names_every_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    bad = unmapped_modules(text, repo_files())
    assert not bad, f"modules docs/architecture.md's file map does not name: {bad}"


def test_the_check_sees_a_moved_path() -> None:
    files = ["engine/httpkit/error_status.py", "engine/server/app.py"]
    text = "`engine/httpkit/error_status.py`, `server/app.py`, `engine/server/error_status.py`"
    assert missing_paths(text, files) == ["engine/server/error_status.py"]
