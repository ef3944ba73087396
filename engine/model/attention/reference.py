"""Reference paged attention: the definition of correct (CPU, tests), one sequence at a time.

The cache of one rank is ``[num_blocks, num_layers, 2, num_kv_heads_local, block_size, head_dim]``.
It reads the host copies of the step metadata and syncs freely; the fast backends are
checked against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.attention.metadata import AttentionMetadata


def write_kv(
    kv_cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    """Store the step's ``k, v [T, Hkv, D]`` at ``slot_mapping [T]`` (slots < 0 are skipped)."""
    if slot_mapping.numel() == 0:
        return
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.long)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    blocks = slots // block_size
    offsets = slots % block_size
    layer_cache = kv_cache[:, layer]  # [num_blocks, 2, Hkv, block_size, D]
    # Advanced indices split by a slice put the token dim first: [T, Hkv, D].
    layer_cache[blocks, 0, :, offsets] = k.to(kv_cache.dtype)
    layer_cache[blocks, 1, :, offsets] = v.to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    seq_len: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one sequence's first ``seq_len`` keys and values, each ``[Hkv, seq_len, D]``."""
    num_blocks = (seq_len + block_size - 1) // block_size
    if block_table.numel() < num_blocks:
        raise ValueError(
            f"block table has {block_table.numel()} blocks, seq_len {seq_len} needs {num_blocks}"
        )
    table = block_table[:num_blocks].to(device=kv_cache.device, dtype=torch.long)
    kv = kv_cache[table, layer]  # [nb, 2, Hkv, bs, D]
    nb, _, heads, bs, dim = kv.shape
    k = kv[:, 0].permute(1, 0, 2, 3).reshape(heads, nb * bs, dim)[:, :seq_len]  # [Hkv, L, D]
    v = kv[:, 1].permute(1, 0, 2, 3).reshape(heads, nb * bs, dim)[:, :seq_len]  # [Hkv, L, D]
    return k, v


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [Hq, Lq, D]`` (the last Lq of Lk positions) against ``k, v [Hkv, Lk, D]``."""
    num_heads, q_len, _ = q.shape
    kv_heads, k_len, dim = k.shape
    if kv_heads != num_heads:
        group = num_heads // kv_heads
        k = k[:, None].expand(kv_heads, group, k_len, dim).reshape(num_heads, k_len, dim)
        v = v[:, None].expand(kv_heads, group, k_len, dim).reshape(num_heads, k_len, dim)
    if q_len == k_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if q_len == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    q_pos = torch.arange(k_len - q_len, k_len, device=q.device)
    mask = torch.arange(k_len, device=q.device)[None, :] <= q_pos[:, None]  # [Lq, Lk]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class ReferenceAttentionBackend:
    """Per-sequence SDPA over gathered K/V (any device, any dtype)."""

    name = "reference"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write the new ``k, v [T, Hkv, D]`` into the cache, attend ``q [T, Hq, D]``.

        Returns ``[T, Hq, D]``; row ``t`` of sequence ``i`` sits at position
        ``seq_lens[i] - query_lens[i] + (t - query_start[i])`` and sees keys up to it.
        """
        write_kv(kv_cache, layer, k, v, attn.slot_mapping, attn.block_size)
        out = torch.empty_like(q)
        for i in range(attn.num_seqs):
            q_len, seq_len, start = attn.query_lens[i], attn.seq_lens[i], attn.query_start[i]
            if q_len == 0:
                continue
            q_i = q[start : start + q_len].transpose(0, 1)  # [Hq, Lq, D]
            if q_len == seq_len:
                # Whole context is new this step: use it directly instead of re-reading the cache.
                k_i = k[start : start + q_len].transpose(0, 1).to(kv_cache.dtype)  # [Hkv, L, D]
                v_i = v[start : start + q_len].transpose(0, 1).to(kv_cache.dtype)
            else:
                table = attn.block_tables[i]
                k_i, v_i = gather_kv(kv_cache, layer, table, seq_len, attn.block_size)
            o_i = _causal_attention(q_i, k_i.to(q.dtype), v_i.to(q.dtype), scale)  # [Hq, Lq, D]
            out[start : start + q_len] = o_i.transpose(0, 1)
        return out
