"""The model's small per-layer operations: RMSNorm (with the residual add folded in), rotary
embedding and SiLU-and-multiply, in two interchangeable sets.

- ``reference`` (``reference.py``): plain torch, the definition of correct; CPU and tests.
- ``triton`` (``triton_ops.py``): one Triton launch each, where torch runs 3-10 small
  kernels (casts, ``pow``, ``mean``, ``rsqrt``, ``cat``, ...). On a GPU a decode step is
  bound by the number of kernels, not by bytes (docs/performance.md, "What the profile
  showed"); these ops were most of them. Checked against the reference on CPU tensors
  with ``TRITON_INTERPRET=1`` (``tests/test_triton_ops.py``).

The set follows the attention backend (``--attention-backend``): ``triton`` attention gets
the Triton ops, ``reference`` the torch ones, so one flag picks the whole fast path.

The contract, for ``x [T, H]`` rows of ``dtype`` and fp32 math inside every op::

    rms_norm(x, weight, eps) -> [T, H]
        weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)          (HF Llama's RMSNorm)
    add_rms_norm(x, residual, weight, eps) -> (rms_norm(s), s)   s = x + residual in dtype
    rotary(rope, q [T, Hq, D], k [T, Hkv, D]) -> (q', k')        rotate-half (NeoX) layout
        rope = (cos, sin) [T, 1, D] fp32; may rotate q and k in place
    silu_and_mul(x [T, 2I]) -> [T, I]                           silu(x[:, :I]) * x[:, I:]
"""

from __future__ import annotations

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


def get_model_ops(attention_backend: str) -> ModelOps:
    """The op set that goes with the (resolved) attention backend ``reference`` or ``triton``."""
    if attention_backend == "triton":
        from engine.model.ops.triton_ops import TritonOps

        return TritonOps()
    if attention_backend == "reference":
        from engine.model.ops.reference import ReferenceOps

        return ReferenceOps()
    raise ValueError(f"no model ops for attention backend {attention_backend!r}")


__all__ = ["ModelOps", "get_model_ops"]
