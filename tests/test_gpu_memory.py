"""The KV cache's share of a GPU (``--gpu-memory-utilization``): the arithmetic of
``kv_cache_budget``, fed the numbers ``ModelRunner.profile_kv_bytes`` reads from CUDA."""

from __future__ import annotations

from engine.worker.gpu_memory import kv_cache_budget

GIB = 2**30
TOTAL = 140 * GIB


def test_memory_held_by_another_process_is_not_counted_as_this_nodes():
    # A prefill node already holds 60 GiB of the GPU; a decode node starts at 0.45.
    free_at_start = TOTAL - 60 * GIB
    weights, activations = 2 * GIB, 1 * GIB
    reserved = weights + GIB // 2  # torch's allocator after the dummy forward, cache emptied
    b = kv_cache_budget(
        total=TOTAL,
        utilization=0.45,
        free_at_start=free_at_start,
        free_now=free_at_start - reserved,
        reserved_now=reserved,
        weights=weights,
        peak=weights + activations,
    )
    assert b.non_torch == 0
    assert b.kv_bytes == int(TOTAL * 0.45) - weights - activations
    assert not b.limited_by_free


def test_this_processes_memory_outside_torch_is_subtracted():
    weights, reserved, nccl = 2 * GIB, 3 * GIB, GIB
    b = kv_cache_budget(
        total=TOTAL,
        utilization=0.9,
        free_at_start=TOTAL,
        free_now=TOTAL - reserved - nccl,
        reserved_now=reserved,
        weights=weights,
        peak=weights + GIB,
    )
    assert b.non_torch == nccl
    assert b.kv_bytes == int(TOTAL * 0.9) - weights - GIB - nccl


def test_other_processes_leaving_less_than_the_share_limit_the_cache_to_what_is_free():
    # Others took 100 GiB after this node's share was planned: only what is free is used.
    weights = 2 * GIB
    b = kv_cache_budget(
        total=TOTAL,
        utilization=0.5,
        free_at_start=TOTAL - 100 * GIB,
        free_now=TOTAL - 100 * GIB - weights,
        reserved_now=weights,
        weights=weights,
        peak=weights + GIB,
    )
    assert b.limited_by_free
    assert b.kv_bytes == b.free - GIB < int(TOTAL * 0.5) - weights - GIB


def test_a_share_smaller_than_the_weights_gives_no_cache_not_a_negative_one():
    b = kv_cache_budget(
        total=TOTAL,
        utilization=0.01,
        free_at_start=TOTAL,
        free_now=TOTAL - 3 * GIB,
        reserved_now=3 * GIB,
        weights=3 * GIB,
        peak=4 * GIB,
    )
    assert b.kv_bytes == 0


def test_memory_this_process_held_before_the_runner_counts_only_as_used_memory():
    """``--distributed-executor-backend uni``: the runner lives in a process that already
    holds 20 GiB (say a transformers model, 4 GiB of it cached by torch's allocator). Those
    are not this node's weights or activations: as another process's memory, they limit
    the cache only through what is free."""
    before_alloc, before_reserved = 16 * GIB, 20 * GIB
    free_at_start = TOTAL - before_reserved
    weights, activations, nccl = 2 * GIB, 1 * GIB, GIB // 2
    reserved = before_reserved + weights + GIB // 2
    b = kv_cache_budget(
        total=TOTAL,
        utilization=0.5,
        free_at_start=free_at_start,
        free_now=TOTAL - reserved - nccl,
        reserved_now=reserved,
        weights=before_alloc + weights,  # torch.cuda.memory_allocated: the whole process's
        peak=before_alloc + weights + activations,
        allocated_at_start=before_alloc,
        reserved_at_start=before_reserved,
    )
    assert (b.weights, b.activations, b.non_torch) == (weights, activations, nccl)
    assert b.kv_bytes == int(TOTAL * 0.5) - weights - activations - nccl
    assert not b.limited_by_free
