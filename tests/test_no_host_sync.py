"""No host syncs on the fast path, checked on CPU (issue 7: "never read a GPU value back
until the sampled tokens").

On a GPU a host read (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``.cpu()``, a
boolean-mask index, ``nonzero``) stalls the CPU until the device catches up, and breaks
CUDA-graph capture. The same calls are visible on CPU: ``HostReads`` (a
``TorchFunctionMode``) records every one made while it is active, outside Triton's
interpreter (which runs the kernels through numpy here; on a GPU they are compiled).
A GPU run confirms with ``torch.cuda.set_sync_debug_mode`` (``tests/test_gpu.py``).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from engine.kv_cache_layout import KVCacheSpec  # noqa: E402
from engine.model.attention import pack_step  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.worker.cuda_graphs import DecodeGraphs  # noqa: E402
from engine.worker.sampler import Sampler  # noqa: E402

BS = 16
READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}
DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}


def _inside_triton() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if f"{os.sep}triton{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class HostReads(TorchFunctionMode):
    """Records (name, where) for each host read of a tensor while active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        hit = name in READS or name in DATA_DEPENDENT
        if name in ("__getitem__", "__setitem__") and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            hit = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        if hit and not _inside_triton():
            ours = [f for f in traceback.extract_stack() if f"{os.sep}engine{os.sep}" in f.filename]
            where = f"{ours[-1].filename.rsplit(os.sep, 2)[-1]}:{ours[-1].lineno}" if ours else "?"
            self.reads.append((name, where))
        return func(*args, **(kwargs or {}))


def _model_and_cache() -> tuple[Any, Any, torch.Tensor]:
    net, cfg = load_model("tiny", attention_backend="triton")
    spec = KVCacheSpec(
        32, cfg.num_hidden_layers, cfg.num_key_value_heads, BS, cfg.head_dim, torch.float32
    )
    return net, cfg, spec.allocate()


def test_the_detector_sees_the_reads_it_is_meant_to_catch() -> None:
    x = torch.arange(6)
    with HostReads() as mode:
        x.sum().item()
        bool((x > 2).any())
        x[x > 1]
        x.tolist()
    assert [name for name, _ in mode.reads] == ["item", "__bool__", "__getitem__", "tolist"]


def test_a_mixed_step_forward_and_its_logits_read_nothing_back() -> None:
    """Prefills, a chunk over a cached prefix and decodes in one step: metadata is packed
    on the host and copied over; the forward and the logits never read a device value."""
    net, _, cache = _model_and_cache()
    first = pack_step([list(range(1, 21)), [5, 6, 7]], [0, 0], [[1, 2], [3]], BS)
    first = first.to_device(torch.device("cpu"))
    net(first.input_ids, first.positions, first.attn, cache)
    # Decodes of both, a new prompt, and a chunk continuing at position 20 of a third.
    tokens = [[30], [8], list(range(40, 52)), list(range(60, 70))]
    starts = [20, 3, 0, 20]
    tables = [[1, 2], [3], [4], [5, 6]]
    packed = pack_step(tokens, starts, tables, BS)
    with HostReads() as mode:
        step = packed.to_device(torch.device("cpu"))
        hidden = net(step.input_ids, step.positions, step.attn, cache)  # [T, H]
        rows = torch.tensor([0, 1, 13, 23]).to(hidden.device, non_blocking=True)
        net.compute_logits(hidden[rows])
    assert mode.reads == []


def test_the_padded_decode_path_that_cuda_graphs_replay_reads_nothing_back() -> None:
    net, _, cache = _model_and_cache()
    prefill = pack_step([[3, 4, 5], [9]], [0, 0], [[1], [2]], BS).to_device(torch.device("cpu"))
    net(prefill.input_ids, prefill.positions, prefill.attn, cache)
    graphs = DecodeGraphs(
        net, cache, BS, width=8, max_num_seqs=8, device=torch.device("cpu"), capture=False
    )
    with HostReads() as mode:
        graphs.run([[11], [12]], [3, 1], [[1], [2]])
    assert mode.reads == []


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0.0)] * 3,
        [
            SamplingParams(temperature=0.8, top_k=5, seed=1),
            SamplingParams(temperature=1.0, top_p=0.9),
            SamplingParams(temperature=0.0),
        ],
    ],
    ids=["greedy", "mixed"],
)
def test_sampling_reads_back_only_the_sampled_ids(params: list[SamplingParams]) -> None:
    logits = torch.randn(3, 50)
    with HostReads() as mode:
        tokens = Sampler().sample(logits, params, [4, 9, 2], [(), (), ()])
    assert len(tokens) == 3
    assert [name for name, _ in mode.reads] == ["tolist"]
