"""What both sides of the UCXX transport use of ``ucxx``: importing it, a request's state,
and the buffers UCX sends from or receives into (views of the KV cache, staging buffers).

Environment: importing ``ucxx`` sets ``UCX_MEMTYPE_CACHE``, ``UCX_RNDV_THRESH`` and
``UCX_RNDV_FRAG_MEM_TYPE`` in ``os.environ`` for the whole process; ``load_ucxx`` restores
the environment right after the import, so NIXL agents in the same process and child
processes see the user's UCX settings only. ``UCX_TLS`` / ``UCX_NET_DEVICES`` apply to the
``ucxx`` context as to NIXL's.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from typing import Any

import torch

_POOL_MAX_BYTES = 512 << 20  # staging buffers kept for reuse, per transport
_POOL_MIN_BUCKET = 64 << 10

_ucx: Any = None  # ucxx._lib.libucxx, once imported
_Array: Any = None  # ucxx._lib.arr.Array
_import_lock = threading.Lock()


def ucxx_available() -> bool:
    """True when ``ucxx`` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("ucxx") is not None
    except (ImportError, ValueError):
        return False


class UcxxTransportError(RuntimeError):
    """Setup of the transport or of a peer failed."""


def load_ucxx() -> tuple[Any, Any]:
    """Import ``ucxx`` once, leaving ``os.environ`` as it was (see the module docstring):
    ``(ucxx._lib.libucxx, ucxx._lib.arr.Array)``."""
    global _ucx, _Array
    with _import_lock:
        if _ucx is None:
            saved = {k: v for k, v in os.environ.items() if k.startswith("UCX")}
            try:
                import ucxx._lib.libucxx as ucx
                from ucxx._lib.arr import Array
            except ImportError as exc:
                raise UcxxTransportError(
                    "the ucxx transport needs ucxx: pip install -e '.[ucxx]' "
                    "(or start the node with --kv-transport nixl)"
                ) from exc
            finally:
                for key in [k for k in os.environ if k.startswith("UCX") and k not in saved]:
                    del os.environ[key]
                os.environ.update(saved)
            _ucx, _Array = ucx, Array
    return _ucx, _Array


def req_state(req: Any) -> tuple[bool, str | None]:
    """(completed, error) of a ucxx request, without raising."""
    if not req.completed:
        return False, None
    try:
        req.check_error()
    except Exception as exc:
        return True, f"{type(exc).__name__}: {exc}"
    return True, None


def wide(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor's last (contiguous) dim as the widest integer word that divides it:
    torch's ``index_select``/``index_copy_`` move uint8 rows ~7x slower than int64 rows."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if t.shape[-1] % size == 0 and t.storage_offset() % size == 0:
            return t.view(dtype)
    return t


def np_bytes(t: torch.Tensor) -> Any:
    """A 1-D uint8 view UCX can send from or receive into (no copy)."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


def unit_view(
    blocks: torch.Tensor, num_layers: int | None, heads: int | None, head_bytes: int
) -> torch.Tensor:
    """``blocks`` (one row of bytes per block) as (block, layer x kv, head, head bytes)."""
    assert num_layers is not None and heads
    return blocks.view(-1, 2 * num_layers, heads, head_bytes)


class StagingPool:
    """Reusable 1-D uint8 buffers in power-of-two buckets, on the KV cache's device."""

    def __init__(self, device: torch.device, max_bytes: int = _POOL_MAX_BYTES) -> None:
        self.device = device
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._bytes = 0

    @staticmethod
    def _bucket(n: int) -> int:
        return max(_POOL_MIN_BUCKET, 1 << max(0, n - 1).bit_length())

    def get(self, n: int) -> torch.Tensor:
        bucket = self._bucket(n)
        free = self._free.get(bucket)
        if free:
            buf = free.pop()
            self._bytes -= bucket
        else:
            buf = torch.empty(bucket, dtype=torch.uint8, device=self.device)
        return buf[:n]

    def put(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        bucket = base.numel()
        if bucket != self._bucket(bucket) or self._bytes + bucket > self.max_bytes:
            return
        self._free.setdefault(bucket, []).append(base)
        self._bytes += bucket

    def clear(self) -> None:
        self._free.clear()
        self._bytes = 0
