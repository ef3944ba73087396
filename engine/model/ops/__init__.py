"""The model's small per-layer operations: RMSNorm (with the residual add folded in), rotary
embedding and SiLU-and-multiply, in two interchangeable sets.

- ``reference`` (``reference.py``): plain torch, the definition of correct; CPU and tests.
- ``triton`` (``triton_ops.py``): one Triton launch each, where torch runs 3-10 small
  kernels (casts, ``pow``, ``mean``, ``rsqrt``, ``cat``, ...). On a GPU a decode step is
  bound by the number of kernels, not by bytes (docs/performance.md, "What the profile
  showed"); these ops were most of them. Checked against the reference on CPU tensors
  with ``TRITON_INTERPRET=1`` (``tests/test_triton_ops.py``).

Which set runs: the torch ops, unless ``PDSERVE_MODEL_OPS=triton`` and the attention
backend is ``triton`` (the ``reference`` backend stays all torch: the definition of
correct that the fast path is checked against). The Triton ops are opt-in until a
GPU run has checked them compiled and measured what they buy (``scripts/gpu_check.sh``
step ``triton-ops``: the offline rows and the ``gpu`` tests with them, next to the
default's in the same run); then ``DEFAULT_OPS`` below becomes ``triton``, as the
async-scheduling default waited for its rows. The variable
is for that measurement, not a serving option.

The contract, for ``x [T, H]`` rows of ``dtype`` and fp32 math inside every op::

    rms_norm(x, weight, eps) -> [T, H]
        weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)          (HF Llama's RMSNorm)
    add_rms_norm(x, residual, weight, eps) -> (rms_norm(s), s)   s = x + residual in dtype
    rotary(rope, q [T, Hq, D], k [T, Hkv, D]) -> (q', k')        rotate-half (NeoX) layout
        rope = (cos, sin) [T, 1, D] fp32; may rotate q and k in place
    silu_and_mul(x [T, 2I]) -> [T, I]                           silu(x[:, :I]) * x[:, I:]
"""

from __future__ import annotations

import os
from typing import Protocol

import torch


class ModelOps(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotary(
        self, rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...


OPS_ENV = "PDSERVE_MODEL_OPS"
OP_SETS = ("reference", "triton")
# Until the Triton ops are measured on a GPU (see above): the torch ops everywhere.
DEFAULT_OPS = "reference"


def get_model_ops(attention_backend: str) -> ModelOps:
    """The op set for a model on the (resolved) attention backend ``reference`` or
    ``triton``: ``PDSERVE_MODEL_OPS`` when set, else ``DEFAULT_OPS``."""
    if attention_backend not in OP_SETS:
        raise ValueError(f"no model ops for attention backend {attention_backend!r}")
    chosen = os.environ.get(OPS_ENV, "") or DEFAULT_OPS
    if chosen not in OP_SETS:
        raise ValueError(
            f"{OPS_ENV}={chosen!r}: choose from {', '.join(OP_SETS)}, or unset it "
            f"for the default ({DEFAULT_OPS})"
        )
    if chosen == "triton" and attention_backend == "triton":
        from engine.model.ops.triton_ops import TritonOps

        return TritonOps()
    from engine.model.ops.reference import ReferenceOps

    return ReferenceOps()


__all__ = ["DEFAULT_OPS", "OPS_ENV", "OP_SETS", "ModelOps", "get_model_ops"]
