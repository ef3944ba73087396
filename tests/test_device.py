"""``--device auto`` (the default): cuda where torch is a CUDA build and an NVIDIA GPU is
visible, else cpu, decided without importing torch (``engine/device.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import REPO_ROOT

from engine.config import ParallelConfig
from engine.device import detect_device


def _host(tmp_path: Path, cuda_torch: bool, gpu: bool) -> tuple[Path, str]:
    lib = tmp_path / "torch" / "lib"
    lib.mkdir(parents=True)
    (lib / "libtorch_cpu.so").touch()
    if cuda_torch:
        (lib / "libtorch_cuda.so").touch()
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").touch()  # the control device is not a GPU
    if gpu:
        (dev / "nvidia0").touch()
    return lib, str(dev / "nvidia[0-9]*")


def test_auto_is_cuda_only_with_a_cuda_torch_and_a_visible_gpu(tmp_path: Path) -> None:
    for cuda_torch, gpu, want in [(True, True, "cuda"), (True, False, "cpu"), (False, True, "cpu")]:
        sub = tmp_path / f"{cuda_torch}-{gpu}"
        lib, devices = _host(sub, cuda_torch, gpu)
        assert detect_device(lib, devices, {}) == want, (cuda_torch, gpu)
    lib, devices = _host(tmp_path / "hidden", True, True)
    for hidden in ("", "-1"):
        assert detect_device(lib, devices, {"CUDA_VISIBLE_DEVICES": hidden}) == "cpu"
    assert detect_device(lib, devices, {"CUDA_VISIBLE_DEVICES": "1"}) == "cuda"


def test_the_config_holds_the_device_auto_resolved_to() -> None:
    assert ParallelConfig().device == detect_device()  # this host's: cpu in CI
    assert ParallelConfig(device="cpu").device == "cpu"


def test_a_nodes_flags_with_device_auto_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from engine.server.cli_args import parse_config\n"
        "from engine.server.node_main import build_parser\n"
        "args, config = parse_config(build_parser('decode'), [])\n"
        "print(config.parallel.device, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [detect_device(), "False"]
