"""The engine process's modules import without torch (its TP workers load it): a fresh
interpreter imports the node, engine and proxy entry points with torch made unimportable."""

from __future__ import annotations

import subprocess
import sys

from harness import REPO_ROOT

ENGINE_PROCESS_MODULES = (
    "decode_node.cli",
    "prefill_node.cli",
    "engine.server.node_main",
    "engine.async_engine",
    "engine.engine_core",
    "kvconnector.factory",
    "kvconnector.nixl.scheduler",
    "proxy.cli",
)

BLOCK_TORCH = """
import sys, traceback
class NoTorch:
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            traceback.print_stack(limit=8)
            raise ImportError("torch imported by the engine process")
sys.meta_path.insert(0, NoTorch())
for name in sys.argv[1:]:
    __import__(name)
"""


def test_the_engine_process_modules_import_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, *ENGINE_PROCESS_MODULES],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_node_starts_its_workers_before_importing_the_http_stack() -> None:
    """``run_node`` imports Starlette and uvicorn in a thread while the workers load torch and
    the model: the entry points and the flag parsing must not import them first."""
    code = (
        "import sys, decode_node.cli, prefill_node.cli, engine.server.cli_args\n"
        "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
