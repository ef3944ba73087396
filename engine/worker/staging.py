"""Pinned host buffers for the step's host-to-device copies and the sampled ids' way back."""

from __future__ import annotations

import torch


class HostStaging:
    """Copies a host tensor to the device through pinned buffers kept across steps.

    Pinning memory per step is slow (a driver call); the buffers grow when needed and are
    reused, round robin over ``slots`` of them. Before a buffer is overwritten, the event
    recorded after its last copy is waited on, so an in-flight asynchronous copy never
    reads a half-written buffer. With two slots a copy queued behind a forward still
    running (async scheduling: step N+1's inputs while step N computes) does not make the
    next one wait for that forward. On a CPU device the tensor is returned as it is.
    """

    def __init__(self, device: torch.device, slots: int = 1) -> None:
        self.device = device
        self._pinned: list[torch.Tensor | None] = [None] * slots
        self._copied: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def to_device(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``host`` (1-D) on the device; into ``out[: host.numel()]`` when given."""
        if self.device.type != "cuda":
            if out is None:
                return host
            out[: host.numel()].copy_(host)
            return out
        n = host.numel()
        k = self._next
        self._next = (k + 1) % len(self._pinned)
        copied = self._copied[k]
        if copied is not None:
            copied.synchronize()
        pinned = self._pinned[k]
        if pinned is None or pinned.numel() < n or pinned.dtype != host.dtype:
            pinned = self._pinned[k] = torch.empty(max(n, 4096), dtype=host.dtype, pin_memory=True)
        staged = pinned[:n]
        staged.copy_(host)
        if out is None:
            out = torch.empty(n, dtype=host.dtype, device=self.device)
        out[:n].copy_(staged, non_blocking=True)
        event = self._copied[k] = torch.cuda.Event()
        event.record()
        return out


class PendingIds:
    """Sampled ids on their way to the host: ``result()`` waits for them (on CUDA, for the
    copy queued behind the step's forward) and returns them as ints."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self._host = host
        self._event = event

    def ready(self) -> bool:
        """The ids are on the host (``result()`` will not wait)."""
        return self._event is None or self._event.query()

    def result(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host.tolist()


class Readback:
    """Starts the copy of a step's sampled ids ``[S]`` (int64, on the device) into a pinned
    host buffer without waiting for it; two buffers in turn, so step N+1's copy never
    overwrites step N's before ``PendingIds.result()`` read it (at most one step is held)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._next = 0

    def start(self, ids: torch.Tensor) -> PendingIds:
        if self.device.type != "cuda":
            return PendingIds(ids, None)
        n = ids.numel()
        k = self._next
        self._next = 1 - k
        pinned = self._pinned[k]
        if pinned is None or pinned.numel() < n:
            pinned = self._pinned[k] = torch.empty(max(n, 1024), dtype=ids.dtype, pin_memory=True)
        host = pinned[:n]
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingIds(host, event)
