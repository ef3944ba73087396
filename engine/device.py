"""``--device auto`` (the default): the device a node computes on, chosen without importing
torch, so the API process stays light and CUDA is not initialised in it (its workers do
that, in their own processes)."""

from __future__ import annotations

import functools
import glob
import importlib.util
import logging
import os
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

NVIDIA_DEVICES = "/dev/nvidia[0-9]*"  # what a GPU host, or a container given GPUs, has


def torch_lib_dir() -> Path | None:
    """The installed torch's ``lib`` directory (found, not imported)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def detect_device(
    torch_lib: Path | None = None,
    nvidia_devices: str = NVIDIA_DEVICES,
    environ: dict[str, str] | None = None,
) -> Literal["cpu", "cuda"]:
    """``cuda`` where torch is a CUDA build, an NVIDIA GPU is present and
    ``CUDA_VISIBLE_DEVICES`` does not hide every GPU; else ``cpu`` (as vLLM picks its
    platform). The arguments are for tests."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        why, device = f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU", "cpu"
    else:
        lib = torch_lib if torch_lib is not None else torch_lib_dir()
        if lib is None or not any(lib.glob("libtorch_cuda*.so*")):
            why, device = "torch is a CPU build", "cpu"
        elif not glob.glob(nvidia_devices):
            why, device = f"no NVIDIA GPU ({nvidia_devices})", "cpu"
        else:
            why, device = "torch is a CUDA build and an NVIDIA GPU is present", "cuda"
    logger.info("--device auto: %s (%s)", device, why)
    return device


@functools.cache
def _auto_device() -> Literal["cpu", "cuda"]:
    return detect_device()


def resolve_device(device: str) -> str:
    """``device``, with ``auto`` resolved (probed once per process)."""
    return _auto_device() if device == "auto" else device
