"""The model's small ops as Triton kernels, one launch each (the contract is in ``__init__``).

Every kernel loads its inputs in their dtype, does the math in fp32 and rounds where the
torch reference rounds (the residual sum, the normalised row before the weight, silu's
output before the product), so bf16 results match the reference up to the order of a
row's sum and fused multiply-adds.

- ``_rms_norm_kernel``: one program per row ``[H]``; optionally adds ``residual`` first
  and writes the sum out as the next residual.
- ``_rotary_kernel``: one program per token rotates all of its query and key heads in
  place, as two ``[heads, D/2]`` tiles per half (``q`` and ``k`` are the strided views the
  QKV projection's split gives; nothing is copied).
- ``_silu_and_mul_kernel``: a program per (row, ``BLOCK`` columns) of ``[T, I]``.

Grids are functions of host shapes only, so the launches can be captured in CUDA graphs.
Without a GPU they run on CPU tensors through the Triton interpreter (``TRITON_INTERPRET=1``
set before triton is imported).
"""

from __future__ import annotations

import torch

from engine.model.ops.reference import ReferenceOps

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "engine.model.ops.triton_ops needs the `triton` package (pip install triton); "
        "use the reference attention backend without it"
    ) from exc

# Widest row one RMSNorm program loads at once; wider rows use the reference.
MAX_NORM_BLOCK = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)  # rounded as torch's add
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(mean_square + eps)).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(dtype), mask=mask)


@triton.jit
def _rotate_heads(
    ptr, stride_head, num_heads, d, d_mask, half, cos1, cos2, sin1, sin2, BLOCK_H: tl.constexpr
):
    """Rotate one token's ``num_heads`` heads at ``ptr`` in place: a ``[BLOCK_H, D/2]`` tile
    per half; rotate_half(x) = cat(-x2, x1), so out1 = x1 cos1 - x2 sin1, out2 = x2 cos2 +
    x1 sin2."""
    h = tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & d_mask[None, :]
    first = ptr + h[:, None] * stride_head + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (x1f * cos1 - x2f * sin1).to(x1.dtype), mask=mask)
    tl.store(first + half, (x2f * cos2 + x1f * sin2).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_rope_token,
    num_q_heads,
    num_k_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < half
    rope = token * stride_rope_token + d
    cos1 = tl.load(cos_ptr + rope, mask=d_mask, other=0.0)[None, :]  # [1, D/2] fp32
    cos2 = tl.load(cos_ptr + rope + half, mask=d_mask, other=0.0)[None, :]
    sin1 = tl.load(sin_ptr + rope, mask=d_mask, other=0.0)[None, :]
    sin2 = tl.load(sin_ptr + rope + half, mask=d_mask, other=0.0)[None, :]
    q = q_ptr + token * stride_q_token
    _rotate_heads(q, stride_q_head, num_q_heads, d, d_mask, half, cos1, cos2, sin1, sin2, BLOCK_HQ)
    k = k_ptr + token * stride_k_token
    _rotate_heads(k, stride_k_head, num_k_heads, d, d_mask, half, cos1, cos2, sin1, sin2, BLOCK_HK)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # rounded as torch's silu
    tl.store(
        out_ptr + row * stride_out + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[T, H]`` rows whose last dim is contiguous (a view when it already is)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_launch(n_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    return block, (8 if block >= 2048 else 4)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(x [+ residual]), x + residual or None)``, both shaped like ``x``."""
    shape = x.shape
    x2 = _rows(x)
    rows, n_cols = x2.shape
    out = torch.empty((rows, n_cols), dtype=x.dtype, device=x.device)
    block, warps = _norm_launch(n_cols)
    if residual is None:
        r2 = r_out = x2  # unused by the kernel (HAS_RESIDUAL=False)
    else:
        r2 = _rows(residual)
        r_out = torch.empty_like(out)
    if rows:
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, r_out,
            x2.stride(0), r2.stride(0), out.stride(0), r_out.stride(0),
            n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return out.view(shape), (None if residual is None else r_out.view(shape))


def rotary_(
    rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place by ``rope = (cos, sin) [T, 1, D]``."""
    cos, sin = rope
    tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rotary needs the head dim contiguous"
    cos2 = cos.reshape(tokens, head_dim)  # [T, D] fp32
    sin2 = sin.reshape(tokens, head_dim)
    assert cos2.stride(-1) == 1 and sin2.stride() == cos2.stride()
    if tokens:
        _rotary_kernel[(tokens,)](
            q, k, cos2, sin2,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos2.stride(0),
            num_q_heads, num_k_heads, head_dim // 2,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(num_k_heads),
            BLOCK_D=triton.next_power_of_2(head_dim // 2),
            num_warps=4,
        )  # fmt: skip
    return q, k


SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` -> ``[T, I]``."""
    x2 = _rows(x)
    rows, width = x2.shape
    n_cols = width // 2
    out = torch.empty((rows, n_cols), dtype=x.dtype, device=x.device)
    block = min(SILU_BLOCK, triton.next_power_of_2(n_cols))
    if rows:
        grid = (rows, triton.cdiv(n_cols, block))
        _silu_and_mul_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], n_cols)


class TritonOps(ReferenceOps):
    """The Triton kernels; rows wider than ``MAX_NORM_BLOCK`` keep the reference norm."""

    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if triton.next_power_of_2(x.shape[-1]) > MAX_NORM_BLOCK:
            return super().rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if triton.next_power_of_2(x.shape[-1]) > MAX_NORM_BLOCK:
            return super().add_rms_norm(x, residual, weight, eps)
        out, s = rms_norm(x, weight, eps, residual)
        assert s is not None
        return out, s

    def rotary(
        self, rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_(rope, q, k)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
