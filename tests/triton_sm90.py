"""Compiling our Triton kernels for an H200 (sm_90a) without one: the path the interpreter
never runs (``for`` loops, tensor-core dots), as the runtime would compile it.

A test hands ``compile_in_fresh_python`` a script that patches the kernels it wants with
``capture(module, names)``, calls the Python wrappers (which record each launch: kernel,
arguments, constexprs, options) and ends with ``compile_launches()``: each launch is
compiled with Triton's own compiler down to a cubin (ptxas ships with triton) and one line
per kernel is printed (its name, ``wgmma`` when the PTX uses Hopper's tensor cores, the
options). The script runs in a fresh interpreter without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

DTYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int32: "i32",
    torch.int64: "i64",
}
launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []


class _Capture:
    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))


def capture(module: ModuleType, names: tuple[str, ...]) -> None:
    """Record the launches of ``module``'s kernels ``names`` instead of running them."""
    for name in names:
        setattr(module, name, _Capture(getattr(module, name)))


def compile_launches() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for kernel, args, kwargs in launches:
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        values = dict(zip(kernel.arg_names, args, strict=False), **kwargs)
        signature: dict[str, str] = {}
        constexprs: dict[tuple[int, ...], Any] = {}
        attrs: dict[tuple[int, ...], Any] = {}
        for i, param in enumerate(kernel.params):
            value = values[param.name]
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[(i,)] = value
                continue
            if isinstance(value, torch.Tensor):
                signature[param.name] = "*" + DTYPES[value.dtype]
            elif isinstance(value, float):
                signature[param.name] = "fp32"
            else:
                signature[param.name] = param.annotation_type or "i32"
            if isinstance(value, torch.Tensor) or (isinstance(value, int) and value % 16 == 0):
                attrs[(i,)] = [["tt.divisibility", 16]]  # what the runtime specializes on
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        assert compiled.asm["cubin"], kernel.__name__
        print(kernel.__name__, "wgmma" if "wgmma" in compiled.asm["ptx"] else "", options)


def compile_in_fresh_python(script: str) -> list[str]:
    """Run ``script`` (see the module docstring) without ``TRITON_INTERPRET``; its lines."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout.splitlines()
