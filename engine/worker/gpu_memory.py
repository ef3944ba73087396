"""How much of a GPU the KV cache of one rank gets (``--gpu-memory-utilization``).

The node's share of the device is ``utilization * total``, vLLM's meaning: two nodes at
0.45 can share one GPU. From that share come the weights, the activation peak of a dummy
forward at the largest step, and the memory this process took outside torch's allocator
since the runner started (NCCL, NIXL, library workspaces); the KV cache gets the rest.
Memory held by other processes is not this node's: it limits the cache only through what is
free now (the cache never plans on more than ``free - activations``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheBudget:
    """The numbers behind one rank's KV cache size, in bytes."""

    total: int  # the device's memory
    budget: int  # utilization * total: this node's share
    weights: int
    activations: int  # the dummy forward's peak above the weights
    non_torch: int  # this process's memory outside torch's allocator, since the start
    free: int  # free on the device now (all processes)
    kv_bytes: int  # what the KV cache may take (>= 0)
    limited_by_free: bool  # other processes left less than this node's share


def kv_cache_budget(
    *,
    total: int,
    utilization: float,
    free_at_start: int,
    free_now: int,
    reserved_now: int,
    weights: int,
    peak: int,
    allocated_at_start: int = 0,
    reserved_at_start: int = 0,
) -> KVCacheBudget:
    """``free_at_start``: free device memory when the runner started (before the weights);
    ``free_now``, ``reserved_now``: free memory and torch's reserved memory after the dummy
    forward (its cache emptied); ``weights``: allocated after loading; ``peak``: the dummy
    forward's peak allocation (scratch KV excluded). ``allocated_at_start``,
    ``reserved_at_start``: torch's allocated and reserved memory in this process when the
    runner started -- 0 in a worker process; a runner in its engine's process (``uni``)
    may start in a process already holding memory, which counts as any other process's."""
    budget = int(total * utilization)
    activations = max(0, peak - weights)
    weights = max(0, weights - allocated_at_start)  # this runner's own
    # What this process took since the start, less what torch's allocator took since.
    non_torch = max(0, (free_at_start - free_now) - (reserved_now - reserved_at_start))
    share = budget - weights - activations - non_torch
    room = free_now - activations  # never plan on more than is free now
    return KVCacheBudget(
        total=total,
        budget=budget,
        weights=weights,
        activations=activations,
        non_torch=non_torch,
        free=free_now,
        kv_bytes=max(0, min(share, room)),
        limited_by_free=room < share,
    )
