"""Triton kernels of the paged-attention backend: cache writes and unified attention.

The cache of one rank is ``kv_cache [num_blocks, num_layers, 2, Hkv, block_size, D]``
(index 0 of dim 2 is K, 1 is V), contiguous. Every kernel addresses layer ``layer`` of it
in place through the cache strides; nothing is copied or gathered on the host side.

``reshape_and_cache`` writes the step's ``k, v [T, Hkv, D]`` at ``slot_mapping [T]``
(``slot = block_id * block_size + offset``; a slot < 0 is a padding row and is skipped). One
program per token writes all of its heads.

``unified_attention`` is causal paged attention for a flattened batch in which prefills,
prefill chunks (a cached prefix) and decodes are mixed; it follows the design of vLLM's
Triton "unified attention" kernel:

- The query rows of sequence ``i`` are ``query_start_loc[i] : query_start_loc[i + 1]``; they
  are cut into q-blocks of ``BLOCK_Q`` rows. One program handles one q-block of one sequence
  for one KV head and packs the ``group = Hq // Hkv`` query heads sharing that KV head into
  the M dimension: row ``m`` of the ``[BLOCK_M, D]`` query tile is token
  ``m // group`` of the q-block, query head ``kv_head * group + m % group``
  (``BLOCK_M = next_power_of_2(BLOCK_Q * group)``, at least 16 for ``tl.dot``).
- Sequence ``i``'s q-blocks are numbered from ``query_start_loc[i] // BLOCK_Q + i``, an
  upper bound of the number of q-blocks before it that needs no host sync. So the grid is
  ``T // BLOCK_Q + S`` programs along axis 0 (a function of host ints only: the launch can
  be captured in a CUDA graph and replayed with other sequence lengths); a program finds
  its sequence by a binary search over those starts, and programs past the end of their
  sequence's rows exit at once.
- The program walks the sequence's keys in tiles of ``TILE_N`` positions (a tile may span
  several cache blocks or a part of one: every key position looks its block up in the block
  table), ``S = Q K^T`` and ``acc += P V`` with ``tl.dot``, online softmax in fp32 (running
  max ``m_i``, running sum ``l_i``, ``acc``) with ``exp2`` and ``scale * log2(e)`` folded into
  one multiplier. Query row ``j`` of a sequence sits at position ``seq_len - q_len + j`` and
  sees keys ``0 ..`` that position; the loop stops at the tile holding the last key visible
  to the q-block's last row, and keys at or past that bound are never loaded (masked loads),
  so whatever the cache holds beyond a sequence's length never enters the result.
- Split-KV ("3D") variant, for decode batches too small to fill the GPU: axis 2 of the grid
  cuts each q-block's key tiles into ``num_segments`` (a host int) contiguous segments; each
  writes its unnormalised ``acc`` and its ``m_i, l_i`` to fp32 scratch, and a second kernel
  merges the segments of each (row, head). Empty segments write ``m = -inf, l = 0``.

Rows that see no key at all (CUDA-graph padding sequences with ``seq_len`` 0) come out as 0.
Accumulation is fp32 for every dtype; fp32 inputs use ``input_precision="ieee"`` dots so the
result matches an fp32 reference tightly.

Tile sizes (``AttentionLaunchConfig``) come from ``choose_launch_config`` (host ints only);
``launch_unified_attention`` takes them explicitly, and any valid config gives the same
result. ``unified_attention`` picks the split-KV variant for decode-only batches
(``max_query_len == 1``) with fewer than ``2 * SMs`` (sequence, KV head) pairs.

On a machine without a GPU the kernels run on CPU tensors through the Triton interpreter:
``TRITON_INTERPRET=1`` must be in the environment before this module is imported. Two
interpreter bugs of Triton 3.6 are worked around under the ``INTERPRET`` constexpr (compiled
kernels never see it): a runtime ``range`` bound (the key loop is a ``while`` loop there) and
bf16 ``tl.dot`` (operands widened to fp32 there).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "engine.model.attention.triton_kernels needs the `triton` package "
        "(pip install triton); use the reference attention backend without it"
    ) from exc

_LOG2E = math.log2(math.e)
# Most KV-split segments a decode launch uses (a power of two: the merge loads them as one
# tile).
MAX_SEGMENTS = 16


# --------------------------------------------------------------------------------------
# Cache write
# --------------------------------------------------------------------------------------


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    kv_ptr,  # [num_blocks, num_layers, 2, Hkv, block_size, D]
    slot_ptr,  # [T]
    layer_offset: tl.int64,  # layer * kv_cache.stride(1)
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    stride_v_tok: tl.int64,
    stride_v_head: tl.int64,
    stride_c_blk: tl.int64,
    stride_c_kv: tl.int64,
    stride_c_head: tl.int64,
    stride_c_tok: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, HEADS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [H, D]

    k = tl.load(
        k_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :],
        mask=mask,
    )
    v = tl.load(
        v_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :],
        mask=mask,
    )
    # [Hkv, D] at kv_cache[block, layer, 0 | 1, :, offset, :]
    dst = (
        kv_ptr
        + layer_offset
        + block * stride_c_blk
        + offset * stride_c_tok
        + offs_h[:, None] * stride_c_head
        + offs_d[None, :]
    )
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k, v [T, Hkv, D]`` into ``kv_cache[:, layer]`` at ``slot_mapping [T]``.

    ``slot = block_id * block_size + offset``; rows whose slot is < 0 are skipped (padding).
    Values are cast to the cache dtype. One launch, no host sync.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_cache(kv_cache, layer, num_kv_heads, head_dim)
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} for {num_tokens} tokens")
    if num_tokens == 0:
        return
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    slot_mapping = slot_mapping.contiguous()
    block_size = kv_cache.shape[4]
    _reshape_and_cache_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        layer * kv_cache.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 2,
    )


# --------------------------------------------------------------------------------------
# Attention: shared pieces
# --------------------------------------------------------------------------------------


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence ``i`` whose first q-block ``query_start_loc[i] // BLOCK_Q + i`` is
    at most ``q_block_idx`` (those starts strictly increase with ``i``)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if start <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc + a @ b`` in fp32.

    Under the interpreter the operands are widened to fp32 first: Triton 3.6's interpreter
    multiplies bf16 operands as their raw uint16 bits. (Exact either way: a product of two
    bf16/fp16 values is exact in fp32, as on the tensor cores.)
    """
    if INTERPRET:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, HEAD_DIM_PADDED] fp32
    m_i,  # [BLOCK_M] fp32, running max (log2 domain)
    l_i,  # [BLOCK_M] fp32, running sum
    tile,  # index of the key tile: positions tile * TILE_N ..
    q,  # [BLOCK_M, HEAD_DIM_PADDED], cache dtype
    k_base,  # pointer to kv_cache[0, layer, 0, kv_head, 0, 0]
    v_base,  # pointer to kv_cache[0, layer, 1, kv_head, 0, 0]
    block_table_row,  # pointer to block_tables[seq]
    query_pos,  # [BLOCK_M] absolute position of each row
    row_valid,  # [BLOCK_M]
    kv_limit,  # keys at >= kv_limit are never loaded
    qk_scale,  # scale * log2(e)
    stride_c_blk,
    stride_c_tok,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One step of the online softmax: fold key tile ``tile`` into ``acc, m_i, l_i``."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = offs_d < HEAD_DIM
    key_pos = tile * TILE_N + offs_n  # [TILE_N]
    key_valid = key_pos < kv_limit
    block_ids = tl.load(block_table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
    key_off = (
        block_ids.to(tl.int64) * stride_c_blk + (key_pos % BLOCK_SIZE) * stride_c_tok
    )  # [TILE_N]
    # K^T: [HEAD_DIM_PADDED, TILE_N]; V: [TILE_N, HEAD_DIM_PADDED]
    k = tl.load(
        k_base + key_off[None, :] + offs_d[:, None],
        mask=dim_mask[:, None] & key_valid[None, :],
        other=0.0,
    )
    v = tl.load(
        v_base + key_off[:, None] + offs_d[None, :],
        mask=key_valid[:, None] & dim_mask[None, :],
        other=0.0,
    )
    s = _mma(q, k, tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32), DOT_PRECISION, INTERPRET)
    s = s * qk_scale  # [BLOCK_M, TILE_N]
    causal = key_pos[None, :] <= query_pos[:, None]  # [BLOCK_M, TILE_N]
    visible = row_valid[:, None] & key_valid[None, :] & causal
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
    # A row with no visible key yet keeps m = -inf; shift it by 0 instead (p = 0 then).
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])  # [BLOCK_M, TILE_N]
    alpha = tl.exp2(m_i - m_shift)  # [BLOCK_M]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, INTERPRET)
    return acc, m_new, l_i


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    tile_lo,
    tile_hi,
    q,
    k_base,
    v_base,
    block_table_row,
    query_pos,
    row_valid,
    kv_limit,
    qk_scale,
    stride_c_blk,
    stride_c_tok,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Fold key tiles ``tile_lo .. tile_hi - 1`` into ``acc, m_i, l_i`` (see ``_attend_tile``).

    Compiled, this is a ``for`` loop (which Triton software-pipelines over ``num_stages``).
    Under the interpreter (``INTERPRET``) it is a ``while`` loop: Triton 3.6's interpreter
    cannot take a runtime ``range`` bound with numpy >= 2.4 (triton-lang/triton#9171).
    """
    if INTERPRET:
        tile = tile_lo
        while tile < tile_hi:
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, tile, q, k_base, v_base, block_table_row, query_pos,
                row_valid, kv_limit, qk_scale, stride_c_blk, stride_c_tok, BLOCK_SIZE,
                HEAD_DIM, HEAD_DIM_PADDED, BLOCK_M, TILE_N, DOT_PRECISION, INTERPRET,
            )  # fmt: skip
            tile += 1
    else:
        for tile in range(tile_lo, tile_hi):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, tile, q, k_base, v_base, block_table_row, query_pos,
                row_valid, kv_limit, qk_scale, stride_c_blk, stride_c_tok, BLOCK_SIZE,
                HEAD_DIM, HEAD_DIM_PADDED, BLOCK_M, TILE_N, DOT_PRECISION, INTERPRET,
            )  # fmt: skip
    return acc, m_i, l_i


# --------------------------------------------------------------------------------------
# Attention kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _unified_attention_kernel(
    out_ptr,  # [T, Hq, D] (2D variant)
    seg_acc_ptr,  # [T, Hq, NUM_SEGMENTS, HEAD_DIM_PADDED] fp32 (split variant)
    seg_max_ptr,  # [T, Hq, NUM_SEGMENTS] fp32 (split variant)
    seg_sum_ptr,  # [T, Hq, NUM_SEGMENTS] fp32 (split variant)
    q_ptr,  # [T, Hq, D]
    kv_ptr,  # [num_blocks, num_layers, 2, Hkv, block_size, D]
    block_tables_ptr,  # [S, max_blocks] int32
    seq_lens_ptr,  # [S] int32
    query_start_loc_ptr,  # [S + 1] int32
    qk_scale,  # scale * log2(e)
    num_seqs: tl.int32,
    layer_offset: tl.int64,  # layer * kv_cache.stride(1)
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    stride_bt: tl.int64,
    stride_c_blk: tl.int64,
    stride_c_kv: tl.int64,
    stride_c_head: tl.int64,
    stride_c_tok: tl.int64,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,  # cache block size
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # next_power_of_2(BLOCK_Q * GROUP), >= 16
    TILE_N: tl.constexpr,  # keys per loop iteration
    NUM_SEGMENTS: tl.constexpr,  # 1: 2D variant, writes out; > 1: split variant
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,  # built for the interpreter (see _attend_tiles, _mma)
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)

    # -1 only if query_start_loc[0] > 0 (rows before it belong to no sequence).
    seq_idx = tl.maximum(_find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q), 0)
    q_start = tl.load(query_start_loc_ptr + seq_idx).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1).to(tl.int32) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq_idx)  # q-block within the sequence
    if (q_block < 0) | (q_block * BLOCK_Q >= q_len):
        return  # past the sequence's rows (the grid is an upper bound)
    seq_len = tl.load(seq_lens_ptr + seq_idx).to(tl.int32)
    context_len = seq_len - q_len  # positions before this step's rows

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = offs_d < HEAD_DIM
    row_in_seq = q_block * BLOCK_Q + offs_m // GROUP  # [BLOCK_M]
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each row
    row_valid = (offs_m < BLOCK_Q * GROUP) & (row_in_seq < q_len)
    row = (q_start + row_in_seq).to(tl.int64)  # [BLOCK_M] row in the flattened batch
    query_pos = context_len + row_in_seq  # [BLOCK_M] absolute position

    q = tl.load(
        q_ptr + row[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(kv_ptr.dtype.element_ty)  # [BLOCK_M, HEAD_DIM_PADDED]

    # Keys the q-block's last row sees: 0 .. kv_limit - 1 (never past seq_len).
    last_row = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_limit = tl.maximum(tl.minimum(context_len + last_row + 1, seq_len), 0)
    num_tiles = tl.cdiv(kv_limit, TILE_N)
    if NUM_SEGMENTS == 1:
        tile_lo = 0
        tile_hi = num_tiles
    else:
        segment = tl.program_id(2)
        tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
        tile_lo = segment * tiles_per_segment
        tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)

    k_base = kv_ptr + layer_offset + kv_head * stride_c_head
    v_base = k_base + stride_c_kv
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, tile_lo, tile_hi, q, k_base, v_base,
        block_tables_ptr + seq_idx * stride_bt, query_pos, row_valid, kv_limit, qk_scale,
        stride_c_blk, stride_c_tok, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_M, TILE_N,
        DOT_PRECISION, INTERPRET,
    )  # fmt: skip

    if NUM_SEGMENTS == 1:
        # Rows without any visible key have l = 0 and acc = 0: they come out as 0.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + row[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_mask[None, :],
        )
    else:
        seg = (row * NUM_Q_HEADS + head) * NUM_SEGMENTS + tl.program_id(2)  # [BLOCK_M]
        tl.store(seg_max_ptr + seg, m_i, mask=row_valid)
        tl.store(seg_sum_ptr + seg, l_i, mask=row_valid)
        tl.store(
            seg_acc_ptr + seg[:, None] * HEAD_DIM_PADDED + offs_d[None, :],
            acc,
            mask=row_valid[:, None],
        )


@triton.jit
def _merge_segments_kernel(
    out_ptr,  # [T, Hq, D]
    seg_acc_ptr,  # [T, Hq, NUM_SEGMENTS, HEAD_DIM_PADDED] fp32
    seg_max_ptr,  # [T, Hq, NUM_SEGMENTS] fp32
    seg_sum_ptr,  # [T, Hq, NUM_SEGMENTS] fp32
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    seg = (row * NUM_Q_HEADS + head) * NUM_SEGMENTS + offs_s  # [NUM_SEGMENTS]
    seg_m = tl.load(seg_max_ptr + seg)
    seg_l = tl.load(seg_sum_ptr + seg)
    m_max = tl.max(seg_m, axis=0)
    m_shift = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(seg_m - m_shift)  # [NUM_SEGMENTS]; an empty segment (m = -inf) weighs 0
    l_total = tl.sum(seg_l * w, axis=0)
    acc = tl.load(seg_acc_ptr + seg[:, None] * HEAD_DIM_PADDED + offs_d[None, :])
    acc = tl.sum(acc * w[:, None], axis=0)  # [HEAD_DIM_PADDED]
    o = acc / tl.where(l_total > 0.0, l_total, 1.0)
    tl.store(
        out_ptr + row * stride_o_tok + head * stride_o_head + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# Built for the Triton interpreter (TRITON_INTERPRET=1 when this module was imported)?
_INTERPRETED = type(_unified_attention_kernel).__name__ == "InterpretedFunction"


# --------------------------------------------------------------------------------------
# Launch configuration and wrappers
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionLaunchConfig:
    """Tile sizes of one ``unified_attention`` launch (all host ints)."""

    block_q: int  # query tokens per program
    block_m: int  # rows of the query tile: next_power_of_2(block_q * group), >= 16
    tile_n: int  # keys per inner-loop iteration, power of two >= 16
    num_segments: int = 1  # 1: 2D kernel; > 1 (power of two): split-KV kernel + merge
    num_warps: int = 4
    num_stages: int = 2


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_launch_config(
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_query_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionLaunchConfig:
    """Tile sizes from host ints only (never from sequence lengths on the device).

    Batches with a prefill (``max_query_len > 1``): about 64 query rows per program for
    16-bit caches (tensor-core ``wgmma`` tiles on sm_90), 32 for fp32 (whose exact ``ieee``
    dots run on the FMA units and need the registers); ``block_q = rows // group`` tokens,
    fewer when no sequence has that many. Decode batches: one token per program and, when
    ``num_seqs * num_kv_heads`` programs would leave the SMs idle, the keys split into up to
    ``MAX_SEGMENTS`` segments. Sizes were checked to compile for sm_90a without register
    spills (D = 128); their speed is untuned.
    """
    group = num_q_heads // num_kv_heads
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    if max_query_len <= 1:
        block_m = max(16, triton.next_power_of_2(group))
        target = 2 * _num_sms(device)
        programs = max(1, num_seqs * num_kv_heads)
        num_segments = 1
        if programs < target:
            num_segments = min(MAX_SEGMENTS, triton.next_power_of_2(triton.cdiv(target, programs)))
        num_warps = 8 if block_m * head_dim_padded > 64 * 128 else 4
        return AttentionLaunchConfig(
            block_q=1, block_m=block_m, tile_n=16, num_segments=num_segments, num_warps=num_warps
        )
    rows = 32 if dtype == torch.float32 else 64
    block_q = min(max(1, rows // group), triton.next_power_of_2(max_query_len))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    num_warps = 8 if block_m * head_dim_padded > rows * 128 else 4
    tile_n = 16 if dtype == torch.float32 else 32
    return AttentionLaunchConfig(
        block_q=block_q, block_m=block_m, tile_n=tile_n, num_warps=num_warps
    )


def unified_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention for a flattened batch of ``S`` sequences; returns ``[T, Hq, D]``.

    ``q [T, Hq, D]``; ``query_start_loc [S + 1]`` int32 (sequence ``i`` owns rows
    ``query_start_loc[i] : query_start_loc[i + 1]``); ``seq_lens [S]`` int32 (context length
    after this step: row ``j`` of sequence ``i`` sits at position
    ``seq_lens[i] - q_len_i + j``); ``block_tables [S, max_blocks]`` int32. Keys and values
    (this step's too) are read from ``kv_cache[:, layer]``. GQA: query head ``h`` uses KV
    head ``h // (Hq // Hkv)``. ``max_query_len`` (host int) only picks tile sizes.

    One launch (two for a split-KV decode), no host sync, grid from host ints only.
    """
    config = choose_launch_config(
        num_seqs=seq_lens.shape[0],
        num_q_heads=q.shape[1],
        num_kv_heads=kv_cache.shape[3],
        head_dim=q.shape[2],
        max_query_len=max_query_len,
        dtype=kv_cache.dtype,
        device=q.device,
    )
    return launch_unified_attention(
        q, kv_cache, layer, query_start_loc, seq_lens, block_tables, scale, config, out
    )


def launch_unified_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    config: AttentionLaunchConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``unified_attention`` with explicit tile sizes (correct for any valid ``config``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    _check_cache(kv_cache, layer, num_kv_heads, head_dim)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads for {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    _check_config(config, group)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2:
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)}, block_tables "
            f"{tuple(block_tables.shape)} for {num_seqs} sequences"
        )
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} (last dim contiguous) expected {tuple(q.shape)}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    query_start_loc = query_start_loc.contiguous()
    seq_lens = seq_lens.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()

    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    num_segments = config.num_segments
    if num_segments > 1:
        seg_acc = torch.empty(
            (num_tokens, num_q_heads, num_segments, head_dim_padded),
            dtype=torch.float32,
            device=q.device,
        )
        seg_max = torch.empty(
            (num_tokens, num_q_heads, num_segments), dtype=torch.float32, device=q.device
        )
        seg_sum = torch.empty_like(seg_max)
    else:
        seg_acc = seg_max = seg_sum = out  # unused

    grid = (num_tokens // config.block_q + num_seqs, num_kv_heads, num_segments)
    _unified_attention_kernel[grid](
        out,
        seg_acc,
        seg_max,
        seg_sum,
        q,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * _LOG2E,
        num_seqs,
        layer * kv_cache.stride(1),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        BLOCK_SIZE=kv_cache.shape[4],
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_Q=config.block_q,
        BLOCK_M=config.block_m,
        TILE_N=config.tile_n,
        NUM_SEGMENTS=num_segments,
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        INTERPRET=_INTERPRETED,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_q_heads)](
            out,
            seg_acc,
            seg_max,
            seg_sum,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            NUM_SEGMENTS=num_segments,
            num_warps=1 if head_dim_padded <= 64 else 2,
        )
    return out


def _check_cache(kv_cache: torch.Tensor, layer: int, num_kv_heads: int, head_dim: int) -> None:
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(
            "kv_cache must be [num_blocks, num_layers, 2, Hkv, block_size, D], "
            f"got {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer {layer} out of range for {kv_cache.shape[1]} layers")
    if kv_cache.shape[3] != num_kv_heads or kv_cache.shape[5] != head_dim:
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} holds other heads than [*, {num_kv_heads}, "
            f"{head_dim}]"
        )
    block_size = kv_cache.shape[4]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} is not a power of two")


def _check_config(config: AttentionLaunchConfig, group: int) -> None:
    def pow2(x: int) -> bool:
        return x > 0 and x & (x - 1) == 0

    if config.block_q < 1 or not pow2(config.block_m) or config.block_m < 16:
        raise ValueError(f"bad block_q / block_m in {config}")
    if config.block_q * group > config.block_m:
        raise ValueError(f"{config} has fewer than block_q * group = {config.block_q * group} rows")
    if not pow2(config.tile_n) or config.tile_n < 16:
        raise ValueError(f"tile_n must be a power of two >= 16 in {config}")
    if not pow2(config.num_segments) or config.num_segments > 64:
        raise ValueError(f"num_segments must be a power of two <= 64 in {config}")


__all__ = [
    "MAX_SEGMENTS",
    "AttentionLaunchConfig",
    "choose_launch_config",
    "launch_unified_attention",
    "reshape_and_cache",
    "unified_attention",
]
