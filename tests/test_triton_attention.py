"""The Triton paged-attention kernels against a per-sequence SDPA reference.

Without a GPU the kernels run on CPU tensors through the Triton interpreter, which has to be
switched on before triton (or the kernel module) is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib
import itertools
import math
import random

import pytest

pytest.importorskip("triton")

import torch.nn.functional as F

import engine.model.attention.triton_kernels as tk
from tests.triton_sm90 import compile_in_fresh_python

if not torch.cuda.is_available() and type(tk._unified_attention_kernel).__name__ != (
    "InterpretedFunction"
):
    # Imported (by another test module) before the interpreter was switched on.
    tk = importlib.reload(tk)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
}
# (q_len, seq_len): a whole prefill, a chunk after a cached prefix of 53, decodes.
MIXED = [(100, 100), (37, 90), (1, 1), (1, 16), (1, 17), (1, 63)]
# The same mix, fewer rows (the split-KV merge runs one interpreted program per row and head).
SMALL_MIXED = [(24, 24), (9, 40), (1, 1), (1, 17), (1, 63)]


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


class Batch:
    """A flattened batch over a paged cache whose blocks are handed out in shuffled order."""

    def __init__(
        self,
        seqs: list[tuple[int, int]],
        *,
        num_kv_heads: int,
        group: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        num_layers: int = 2,
        layer: int = 1,
        garbage: str = "random",  # what the cache holds outside the sequences: random | nan
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.seqs, self.layer, self.block_size = seqs, layer, block_size
        self.num_q_heads = num_kv_heads * group
        self.scale = 1.0 / math.sqrt(head_dim)
        needed = [math.ceil(seq_len / block_size) for _, seq_len in seqs]
        num_blocks = sum(needed) + 3  # a few blocks nobody owns
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        width = max(needed + [1]) + 1  # every row padded with 0s
        self.block_tables = torch.zeros((len(seqs), width), dtype=torch.int32)
        self.tables: list[list[int]] = []
        for i, n in enumerate(needed):
            table, ids = ids[:n], ids[n:]
            self.tables.append(table)
            self.block_tables[i, :n] = torch.tensor(table, dtype=torch.int32)

        shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
        if garbage == "nan":
            self.kv_cache = torch.full(shape, float("nan"), dtype=dtype)
            # Real keys/values at each sequence's positions 0 .. seq_len - 1 only.
            for (_, seq_len), table in zip(seqs, self.tables, strict=True):
                for p in range(seq_len):
                    blk, off = table[p // block_size], p % block_size
                    vals = torch.randn((2, num_kv_heads, head_dim), generator=gen)
                    self.kv_cache[blk, layer, :, :, off] = vals.to(dtype)
        else:
            self.kv_cache = torch.randn(shape, generator=gen).to(dtype)
        self.kv_cache = self.kv_cache.to(DEVICE)

        q_lens = [q_len for q_len, _ in seqs]
        self.query_start = [sum(q_lens[:i]) for i in range(len(seqs) + 1)]
        self.num_tokens = self.query_start[-1]
        self.max_query_len = max(q_lens)
        self.q = torch.randn((self.num_tokens, self.num_q_heads, head_dim), generator=gen)
        self.q = self.q.to(dtype).to(DEVICE)
        self.query_start_loc = torch.tensor(self.query_start, dtype=torch.int32, device=DEVICE)
        self.seq_lens = torch.tensor([s for _, s in seqs], dtype=torch.int32, device=DEVICE)
        self.block_tables = self.block_tables.to(DEVICE)

    def run(self, config: "tk.AttentionLaunchConfig | None" = None) -> torch.Tensor:
        """The kernel's output, on the CPU."""
        args = (self.q, self.kv_cache, self.layer, self.query_start_loc, self.seq_lens)
        if config is None:
            out = tk.unified_attention(*args, self.block_tables, self.max_query_len, self.scale)
        else:
            out = tk.launch_unified_attention(*args, self.block_tables, self.scale, config)
        return out.cpu()

    def reference(self) -> torch.Tensor:
        return reference_attention(
            self.q,
            self.kv_cache,
            self.layer,
            self.query_start,
            [s for _, s in self.seqs],
            self.tables,
            self.scale,
        )

    def rows_with_keys(self) -> torch.Tensor:
        """Mask of the rows that see at least one key (not padding sequences)."""
        keep = torch.zeros(self.num_tokens, dtype=torch.bool)
        for i, (q_len, seq_len) in enumerate(self.seqs):
            if seq_len > 0:
                keep[self.query_start[i] : self.query_start[i] + q_len] = True
        return keep


def reference_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start: list[int],
    seq_lens: list[int],
    tables: list[list[int]],
    scale: float,
) -> torch.Tensor:
    """Per-sequence fp32 SDPA over keys gathered through the block table; ``[T, Hq, D]``.

    Rows of sequences with no context (padding) stay 0.
    """
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[4]
    num_q_heads = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start[i], query_start[i + 1]
        q_len = end - start
        if q_len == 0 or seq_len == 0:
            continue
        pos = torch.arange(seq_len)
        blocks = torch.tensor(tables[i], dtype=torch.long)[pos // block_size]
        kv = kv_cache.cpu().float()[blocks, layer, :, :, pos % block_size]  # [L, 2, Hkv, D]
        k = kv[:, 0].transpose(0, 1)  # [Hkv, L, D]
        v = kv[:, 1].transpose(0, 1)  # [Hkv, L, D]
        k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=0)  # [Hq, L, D]
        v = v.repeat_interleave(num_q_heads // num_kv_heads, dim=0)  # [Hq, L, D]
        q_i = q[start:end].cpu().float().transpose(0, 1)  # [Hq, Lq, D]
        q_pos = torch.arange(seq_len - q_len, seq_len)
        mask = pos[None, :] <= q_pos[:, None]  # [Lq, L]
        o = F.scaled_dot_product_attention(q_i, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.cpu().float(), expected, **TOL[dtype])


def split_config(batch: Batch, num_segments: int, block_q: int = 0) -> "tk.AttentionLaunchConfig":
    """A split-KV launch (any batch works; ``block_q`` 0: as many tokens as fit 16 rows)."""
    group = batch.num_q_heads // batch.kv_cache.shape[3]
    block_q = block_q or max(1, 16 // group)
    block_m = max(16, 1 << (block_q * group - 1).bit_length())
    return tk.AttentionLaunchConfig(
        block_q=block_q, block_m=block_m, tile_n=16, num_segments=num_segments
    )


# --------------------------------------------------------------------------------------
# reshape_and_cache
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cache_dtype", "block_size", "head_dim"),
    [(torch.float32, 4, 32), (torch.bfloat16, 16, 64), (torch.float16, 16, 48)],
)
def test_reshape_and_cache_writes_exactly_its_slots(cache_dtype, block_size, head_dim):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_layers, heads, layer = 6, 3, 2, 1
    shape = (num_blocks, num_layers, 2, heads, block_size, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(DEVICE)
    before = kv_cache.clone()
    slots = [5, 3 * block_size, -1, 2 * block_size + 1, num_blocks * block_size - 1, -1]
    num_tokens = len(slots)
    # k, v as strided views of one fused projection: [T, 2 * Hkv * D] -> [T, Hkv, D] each.
    kv = torch.randn((num_tokens, 2 * heads * head_dim), generator=gen).to(DEVICE)
    k = kv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    v = kv[:, heads * head_dim :].view(num_tokens, heads, head_dim)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)

    tk.reshape_and_cache(k, v, kv_cache, layer, slot_mapping)

    expected = before.clone()
    written = torch.zeros(shape, dtype=torch.bool, device=DEVICE)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        expected[slot // block_size, layer, 0, :, slot % block_size] = k[t].to(cache_dtype)
        expected[slot // block_size, layer, 1, :, slot % block_size] = v[t].to(cache_dtype)
        written[slot // block_size, layer, :, :, slot % block_size] = True
    assert torch.equal(kv_cache[~written], before[~written])  # nothing else touched
    # The interpreter casts fp32 -> bf16 by truncation (a GPU rounds to nearest): 1 ulp.
    exact = DEVICE.type == "cuda" or cache_dtype != torch.bfloat16
    torch.testing.assert_close(
        kv_cache[written], expected[written], atol=0, rtol=0 if exact else 2**-7
    )
    assert not torch.equal(kv_cache[written], before[written])


def test_reshape_and_cache_then_attention_reads_this_steps_keys():
    """The step's new K/V go through reshape_and_cache and attention sees them."""
    batch = Batch(
        [(20, 50), (1, 9), (7, 7)],
        num_kv_heads=2, group=2, head_dim=32, block_size=4, dtype=torch.float32,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    num_kv_heads, head_dim = 2, 32
    k = torch.randn((batch.num_tokens, num_kv_heads, head_dim), generator=gen).to(DEVICE)
    v = torch.randn((batch.num_tokens, num_kv_heads, head_dim), generator=gen).to(DEVICE)
    slots = []
    for (q_len, seq_len), table in zip(batch.seqs, batch.tables, strict=True):
        for p in range(seq_len - q_len, seq_len):
            slots.append(table[p // batch.block_size] * batch.block_size + p % batch.block_size)
    tk.reshape_and_cache(
        k, v, batch.kv_cache, batch.layer, torch.tensor(slots, device=DEVICE)
    )  # fmt: skip
    expected = batch.reference()
    assert_close(batch.run(), expected, torch.float32)

    # q and out as strided views (q out of a fused projection, out into a wider buffer).
    num_tokens, heads, dim = batch.q.shape
    wide = torch.zeros((num_tokens, heads * dim + 8), device=DEVICE)
    wide[:, : heads * dim] = batch.q.reshape(num_tokens, heads * dim)
    q = wide[:, : heads * dim].view(num_tokens, heads, dim)
    out_buf = torch.zeros((num_tokens, heads + 1, dim), device=DEVICE)
    out = tk.unified_attention(
        q, batch.kv_cache, batch.layer, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, batch.max_query_len, batch.scale, out=out_buf[:, 1:],
    )  # fmt: skip
    assert out.data_ptr() == out_buf[:, 1:].data_ptr()
    assert_close(out, expected, torch.float32)
    assert torch.equal(out_buf[:, 0], torch.zeros_like(out_buf[:, 0]))


# --------------------------------------------------------------------------------------
# unified_attention
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "group", "head_dim", "block_size"),
    [
        (torch.float32, 1, 64, 16),
        (torch.float32, 2, 32, 4),
        (torch.float32, 4, 64, 32),
        (torch.float32, 3, 48, 16),  # non-power-of-two group and head_dim (padded)
        (torch.bfloat16, 2, 64, 16),
        (torch.bfloat16, 4, 32, 4),
        (torch.float16, 1, 32, 32),
    ],
)
def test_mixed_batch_matches_reference(dtype, group, head_dim, block_size):
    batch = Batch(
        MIXED, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
        dtype=dtype,
    )  # fmt: skip
    assert_close(batch.run(), batch.reference(), dtype)


@pytest.mark.parametrize("garbage", ["random", "nan"])
def test_cache_beyond_seq_len_is_never_read(garbage):
    """Every slot outside the sequences holds garbage (NaN: any read would show)."""
    batch = Batch(
        SMALL_MIXED, num_kv_heads=2, group=2, head_dim=32, block_size=16, dtype=torch.float32,
        garbage=garbage, seed=3,
    )  # fmt: skip
    expected = batch.reference()
    for config in (None, split_config(batch, 4)):
        out = batch.run(config)
        assert torch.isfinite(out).all()
        assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_with_padding_sequences(dtype):
    """CUDA-graph padding: extra sequences with q_len 1, seq_len 0, an all-zero table row."""
    seqs = [(1, 40), (1, 1), (1, 33), (1, 16), (1, 0), (1, 0)]
    batch = Batch(
        seqs, num_kv_heads=2, group=4, head_dim=32, block_size=16, dtype=dtype, garbage="nan"
    )
    expected = batch.reference()
    real = batch.rows_with_keys()
    outs = [batch.run(), batch.run(split_config(batch, 1, 1)), batch.run(split_config(batch, 4, 1))]
    for out in outs:
        assert_close(out[real], expected[real], dtype)
        assert torch.equal(out[~real].float(), torch.zeros_like(expected[~real]))


@pytest.mark.parametrize(
    ("seqs", "num_segments", "block_q"),
    [(SMALL_MIXED, 2, 0), ([(1, 70), (1, 5), (1, 33), (1, 0)], 8, 1)],
)
def test_split_kv_matches_2d_kernel(seqs, num_segments, block_q):
    """The split-KV variant (any segment count, any batch) equals the 2D kernel."""
    batch = Batch(
        seqs, num_kv_heads=2, group=2, head_dim=32, block_size=4, dtype=torch.float32, seed=5
    )
    out_2d = batch.run(tk.AttentionLaunchConfig(block_q=8, block_m=16, tile_n=16))
    out_split = batch.run(split_config(batch, num_segments, block_q))
    real = batch.rows_with_keys()
    assert_close(out_split[real], batch.reference()[real], torch.float32)
    torch.testing.assert_close(out_split, out_2d, atol=1e-5, rtol=1e-5)


def test_tile_sizes_do_not_change_the_result():
    batch = Batch(
        [(45, 60), (1, 70), (13, 13), (2, 5)],
        num_kv_heads=1, group=4, head_dim=16, block_size=16, dtype=torch.float32, seed=6,
    )  # fmt: skip
    expected = batch.reference()
    for block_q, block_m, tile_n in [(1, 16, 16), (16, 64, 64), (3, 16, 32)]:
        config = tk.AttentionLaunchConfig(block_q=block_q, block_m=block_m, tile_n=tile_n)
        assert_close(batch.run(config), expected, torch.float32)


def test_sequences_without_new_tokens_are_skipped():
    """q_len 0 (a sequence scheduled with nothing to compute) between real ones."""
    seqs = [(5, 30), (0, 20), (1, 8), (0, 0), (3, 3)]
    batch = Batch(
        seqs, num_kv_heads=2, group=2, head_dim=16, block_size=4, dtype=torch.float32, seed=7
    )
    assert_close(batch.run(), batch.reference(), torch.float32)
    assert_close(batch.run(split_config(batch, 2)), batch.reference(), torch.float32)


def test_grid_depends_on_host_shapes_only(monkeypatch):
    """Same shapes, other sequence lengths: the same launch (what a CUDA graph replays)."""
    grids = []
    kernel = tk._unified_attention_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(tk, "_unified_attention_kernel", Recorder())
    for seq_lens in ([(1, 3), (1, 40), (1, 0)], [(1, 64), (1, 2), (1, 17)]):
        batch = Batch(
            seq_lens, num_kv_heads=2, group=2, head_dim=16, block_size=16,
            dtype=torch.float32,
        )  # fmt: skip
        real = batch.rows_with_keys()
        assert_close(batch.run()[real], batch.reference()[real], torch.float32)
    assert len(grids) == 2 and grids[0] == grids[1]


def test_small_decode_batch_dispatches_to_split_kv(monkeypatch):
    """One decode on one KV head cannot fill the device: split the keys, then merge."""
    batch = Batch(
        [(1, 75)], num_kv_heads=1, group=4, head_dim=32, block_size=16, dtype=torch.bfloat16,
    )  # fmt: skip
    launched = []
    merge = tk._merge_segments_kernel

    class Recorder:
        def __getitem__(self, grid):
            launched.append(grid)
            return merge[grid]

    monkeypatch.setattr(tk, "_merge_segments_kernel", Recorder())
    assert_close(batch.run(), batch.reference(), torch.bfloat16)
    assert launched == [(1, 4)]


def test_launch_config_choices():
    cpu = torch.device("cpu")
    for group, max_query_len, dtype in itertools.product(
        (1, 2, 3, 4, 6, 8, 16, 32, 64), (1, 2, 37, 500), (torch.bfloat16, torch.float32)
    ):
        config = tk.choose_launch_config(
            num_seqs=8, num_q_heads=2 * group, num_kv_heads=2, head_dim=128,
            max_query_len=max_query_len, dtype=dtype, device=cpu,
        )  # fmt: skip
        assert config.block_m >= max(16, config.block_q * group)
        assert config.block_m & (config.block_m - 1) == 0
        assert config.tile_n >= 16 and config.num_segments >= 1
        if max_query_len == 1:
            assert config.block_q == 1
    # Decode of a single sequence on a one-"SM" device: split in two; a prefill never splits.
    config = tk.choose_launch_config(1, 4, 1, 64, 1, torch.float32, cpu)
    assert config.num_segments == 2
    assert tk.choose_launch_config(1, 4, 1, 64, 9, torch.float32, cpu).num_segments == 1


# Compiled for sm_90a in a fresh interpreter (tests/triton_sm90.py).
_COMPILE_SCRIPT = """
import torch
import engine.model.attention.triton_kernels as tk
from tests.triton_sm90 import capture, compile_launches

assert not tk._INTERPRETED
capture(tk, ("_unified_attention_kernel", "_merge_segments_kernel", "_reshape_and_cache_kernel"))

def attention(dtype, hq, hkv, d, bs, q_len, config=None):
    kv = torch.empty((9, 2, 2, hkv, bs, d), dtype=dtype)
    q = torch.empty((2 * q_len, hq, d), dtype=dtype)
    qsl = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)
    seq_lens = torch.full((2,), 100, dtype=torch.int32)
    tables = torch.zeros((2, 9), dtype=torch.int32)
    if config is None:
        tk.unified_attention(q, kv, 1, qsl, seq_lens, tables, q_len, 0.1)
    else:
        tk.launch_unified_attention(q, kv, 1, qsl, seq_lens, tables, 0.1, config)

attention(torch.bfloat16, 32, 8, 128, 16, 300)  # Llama-3-8B prefill: wgmma tiles
attention(torch.float16, 28, 4, 128, 16, 1)  # Qwen2-7B decode: group 7
attention(torch.float32, 6, 2, 48, 4, 37)  # ieee dots, group 3, padded head_dim
attention(torch.bfloat16, 8, 2, 64, 32, 1, tk.AttentionLaunchConfig(1, 16, 16, num_segments=8))
kv = torch.empty((4, 2, 2, 8, 16, 128), dtype=torch.bfloat16)
k = torch.empty((3, 8, 128), dtype=torch.float32)
tk.reshape_and_cache(k, k, kv, 1, torch.zeros(3, dtype=torch.int64))
compile_launches()
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """The compiled path (``for`` loops, tensor-core dots), which the interpreter never runs."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    lines = compile_in_fresh_python(_COMPILE_SCRIPT)
    assert len(lines) == 6, lines
    assert "wgmma" in lines[0]  # the bf16 prefill runs on Hopper's tensor cores
