"""The Triton model ops (RMSNorm with the residual add, rotary, SiLU-and-multiply) against the
torch reference ops, on CPU tensors through the Triton interpreter (a GPU runs them compiled).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import importlib

import pytest

pytest.importorskip("triton")

import engine.model.ops as ops_module  # noqa: E402
import engine.model.ops.triton_ops as to  # noqa: E402
from engine.model.ops import get_model_ops  # noqa: E402
from engine.model.ops.reference import ReferenceOps  # noqa: E402
from engine.model.rotary import RotaryEmbedding  # noqa: E402
from tests.triton_sm90 import compile_in_fresh_python  # noqa: E402

if not torch.cuda.is_available() and type(to._rms_norm_kernel).__name__ != "InterpretedFunction":
    to = importlib.reload(to)  # imported before the interpreter was switched on

# Triton 3.6's interpreter converts fp32 to bf16 by truncation (the compiled kernels round to
# nearest even, as torch does), so bf16 is compared within tolerance there.
INTERPRETED = type(to._rms_norm_kernel).__name__ == "InterpretedFunction"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Within one rounding of the dtype: the kernels round where the reference rounds, and differ
# only in the order of a row's sum and in fused multiply-adds.
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
REF = ReferenceOps()
FAST = to.TritonOps()


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def test_the_op_set_is_the_default_unless_the_environment_names_one(monkeypatch):
    monkeypatch.delenv("PDSERVE_MODEL_OPS", raising=False)
    default = ops_module.DEFAULT_OPS
    assert get_model_ops("reference").name == "reference"
    assert get_model_ops("triton").name == default
    with pytest.raises(ValueError, match="no model ops"):
        get_model_ops("auto")
    monkeypatch.setenv("PDSERVE_MODEL_OPS", "triton")  # gpu_check.sh's opt-in
    assert get_model_ops("triton").name == "triton"
    assert get_model_ops("reference").name == "reference"  # the reference stays all torch
    monkeypatch.setenv("PDSERVE_MODEL_OPS", "reference")
    assert get_model_ops("triton").name == "reference"
    monkeypatch.setenv("PDSERVE_MODEL_OPS", "fast")
    with pytest.raises(ValueError, match="PDSERVE_MODEL_OPS='fast': choose from reference"):
        get_model_ops("triton")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(7, 64), (3, 100), (1, 2048), (0, 32)])
def test_rms_norm_matches_the_reference(dtype, rows, hidden):
    x = _randn(rows, hidden, dtype=dtype, seed=1) * 3
    weight = _randn(hidden, dtype=dtype, seed=2)
    got = FAST.rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, REF.rms_norm(x, weight, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(9, 64), (2, 96), (1, 2048)])
def test_add_rms_norm_returns_the_norm_of_the_sum_and_the_sum(dtype, rows, hidden):
    x = _randn(rows, hidden, dtype=dtype, seed=3)
    residual = _randn(rows, hidden, dtype=dtype, seed=4) * 5
    weight = _randn(hidden, dtype=dtype, seed=5)
    x_before, residual_before = x.clone(), residual.clone()
    got, got_sum = FAST.add_rms_norm(x, residual, weight, 1e-5)
    want, want_sum = REF.add_rms_norm(x, residual, weight, 1e-5)
    if dtype != torch.bfloat16 or not INTERPRETED:
        torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)  # rounded as torch's add
    torch.testing.assert_close(got_sum, want_sum, **TOL[dtype])
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs kept


def test_rows_wider_than_one_program_loads_fall_back_to_the_reference_norm():
    hidden = to.MAX_NORM_BLOCK + 1
    x = _randn(2, hidden, dtype=torch.float32, seed=8)
    residual = _randn(2, hidden, dtype=torch.float32, seed=9)
    weight = _randn(hidden, dtype=torch.float32, seed=10)
    assert torch.equal(FAST.rms_norm(x, weight, 1e-6), REF.rms_norm(x, weight, 1e-6))
    got, got_sum = FAST.add_rms_norm(x, residual, weight, 1e-6)
    want, want_sum = REF.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(got, want) and torch.equal(got_sum, want_sum)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(4, 2, 16), (6, 2, 48), (3, 3, 8)])
def test_rotary_rotates_the_split_views_of_qkv_in_place_like_the_reference(
    dtype, num_q_heads, num_kv_heads, head_dim
):
    tokens = 11
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(tokens, q_size + 2 * kv_size, dtype=dtype, seed=6)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(tokens, num_q_heads, head_dim)  # strided views, as the model makes them
    k = k.reshape(tokens, num_kv_heads, head_dim)
    v_before = v.clone()
    positions = torch.tensor([0, 1, 2, 3, 17, 100, 511, 4095, 5, 6, 9000], device=DEVICE)
    rope = RotaryEmbedding(head_dim, 10000.0, None, DEVICE).cos_sin(positions)
    want_q, want_k = REF.rotary(rope, q, k)
    got_q, got_k = FAST.rotary(rope, q, k)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert got_q.data_ptr() == q.data_ptr()  # in place: the attention reads qkv's buffer
    assert torch.equal(v, v_before)  # V is not touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(5, 64), (2, 1500), (0, 8)])
def test_silu_and_mul_matches_the_reference(dtype, rows, inter):
    x = _randn(rows, 2 * inter, dtype=dtype, seed=7) * 4
    got = FAST.silu_and_mul(x)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, REF.silu_and_mul(x), **TOL[dtype])


def test_the_model_on_the_triton_ops_matches_the_reference_ops():
    """A whole forward of the tiny model: only the op set differs (both use reference
    attention), so the hidden states agree to fp32 rounding."""
    from engine.kv_cache_layout import KVCacheSpec
    from engine.model.attention import pack_step
    from engine.model.loader import load_model

    net, cfg = load_model("tiny", attention_backend="reference")
    assert net.ops.name == "reference"
    spec = KVCacheSpec(
        16, cfg.num_hidden_layers, cfg.num_key_value_heads, 16, cfg.head_dim, torch.float32
    )
    step = pack_step([list(range(3, 40)), [5, 6, 7]], [0, 0], [[1, 2, 3], [4]], 16)
    step = step.to_device(torch.device("cpu"))
    want = net(step.input_ids, step.positions, step.attn, spec.allocate())
    fast = get_model_ops("triton")
    for module in net.modules():
        if hasattr(module, "ops"):
            module.ops = fast
    got = net(step.input_ids, step.positions, step.attn, spec.allocate())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# Compiled for sm_90a in a fresh interpreter (tests/triton_sm90.py).
_COMPILE_SCRIPT = """
import torch
import engine.model.ops.triton_ops as to
from tests.triton_sm90 import capture, compile_launches

capture(to, ("_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel"))
ops = to.TritonOps()
for dtype in (torch.bfloat16, torch.float32):
    x = torch.empty((4, 2048), dtype=dtype)
    ops.rms_norm(x, x[0], 1e-6)
    ops.add_rms_norm(x, x, x[0], 1e-6)
    qkv = torch.empty((4, (16 + 2 * 8) * 128), dtype=dtype)
    q, k, _ = qkv.split([16 * 128, 8 * 128, 8 * 128], dim=-1)
    cos = torch.empty((4, 1, 128), dtype=torch.float32)
    ops.rotary((cos, cos), q.reshape(4, 16, 128), k.reshape(4, 8, 128))
    ops.silu_and_mul(torch.empty((4, 2 * 5632), dtype=dtype))
compile_launches()
"""


@pytest.mark.slow
def test_the_ops_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia.compiler")
    lines = compile_in_fresh_python(_COMPILE_SCRIPT)
    assert len(lines) == 8, lines
