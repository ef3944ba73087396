"""A reusable pinned host buffer for the step's one host-to-device copy."""

from __future__ import annotations

import torch


class HostStaging:
    """Copies a host tensor to the device through a pinned buffer kept across steps.

    Pinning memory per step is slow (a driver call); this buffer grows when needed and is
    reused. Before it is overwritten, the event recorded after the previous copy is waited
    on, so an in-flight asynchronous copy never reads a half-written buffer. On a CPU device
    the tensor is returned as it is.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def to_device(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``host`` (1-D) on the device; into ``out[: host.numel()]`` when given."""
        if self.device.type != "cuda":
            if out is None:
                return host
            out[: host.numel()].copy_(host)
            return out
        n = host.numel()
        if self._copied is not None:
            self._copied.synchronize()
        if self._pinned is None or self._pinned.numel() < n or self._pinned.dtype != host.dtype:
            self._pinned = torch.empty(max(n, 4096), dtype=host.dtype, pin_memory=True)
        staged = self._pinned[:n]
        staged.copy_(host)
        if out is None:
            out = torch.empty(n, dtype=host.dtype, device=self.device)
        out[:n].copy_(staged, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out
