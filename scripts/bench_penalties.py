#!/usr/bin/env python
"""A/B of ``apply_penalties`` per decode step: the penalties' state kept on the device
and updated with the new tokens only (``engine/worker/penalties.py``, "new") against the
index tensors of every prompt and output id built on the host and copied every step
(the code before, kept below, "old").

Both run in one process on the same logits, step by step, alternating which goes first;
each step's penalized logits must be equal (bit for bit). Each decode step adds one
sampled token to every row's history, as the scheduler's message does, then applies the
penalties; the first step (the prompts go over, once per request) is not counted. Times
are the thread's CPU time (torch on one thread by default), so other processes on a busy
box inflate them less than wall time; "floor" is the [S, V] arithmetic alone, the same
on both sides, on the same state.

    python scripts/bench_penalties.py --rows 8 --prompt 1000 100000 --steps 100 [--json F]

On CPU everything is host work (the [S, V] arithmetic included, the same on both sides);
on a GPU the host share is what the device waits for: GPU figures need a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sampling_params import SamplingParams  # noqa: E402
from engine.worker.penalties import PenaltyHistory, PenaltyPool, apply_penalties  # noqa: E402

ToDevice = Callable[[torch.Tensor, torch.device], torch.Tensor]


# -- the code before (a5c0f1a), verbatim but for the names -----------------------------------
class OldPenaltyHistory:
    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_seen = 0
        self.prompt: set[int] = set()
        self.output: Counter[int] = Counter()
        self._prompt_ids: torch.Tensor | None = None
        self._output: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, token_ids: list[int]) -> None:
        split = max(0, min(len(token_ids), self.num_prompt_tokens - self.num_seen))
        if split:
            self.prompt.update(token_ids[:split])
            self._prompt_ids = None
        if split < len(token_ids):
            self.output.update(token_ids[split:])
            self._output = None
        self.num_seen += len(token_ids)

    def prompt_ids(self) -> torch.Tensor:
        if self._prompt_ids is None:
            self._prompt_ids = torch.tensor(sorted(self.prompt), dtype=torch.int64)
        return self._prompt_ids

    def output_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._output is None:
            ids = torch.tensor(list(self.output), dtype=torch.int64)
            counts = torch.tensor(list(self.output.values()), dtype=torch.int64)
            self._output = (ids, counts)
        return self._output


def old_apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[OldPenaltyHistory | None],
    pending: tuple[list[int], list[int], torch.Tensor] | None,
    to_device: ToDevice,
) -> torch.Tensor:
    num, vocab = logits.shape
    empty = torch.empty(0, dtype=torch.int64)
    out_rows, out_ids, out_counts, seen_rows, seen_ids = [], [], [], [], []
    for i, h in enumerate(histories):
        if h is None:
            continue
        ids, counts = h.output_counts()
        out_rows.append(torch.full_like(ids, i))
        out_ids.append(ids)
        out_counts.append(counts)
        prompt = h.prompt_ids()
        seen_rows.append(torch.full_like(prompt, i))
        seen_ids.append(prompt)
    o_rows, o_ids, o_counts = (
        torch.cat(x) if x else empty for x in (out_rows, out_ids, out_counts)
    )
    s_rows, s_ids = (torch.cat(x) if x else empty for x in (seen_rows, seen_ids))
    keep = (o_ids >= 0) & (o_ids < vocab)
    o_rows, o_ids, o_counts = o_rows[keep], o_ids[keep], o_counts[keep]
    keep = (s_ids >= 0) & (s_ids < vocab)
    s_rows, s_ids = s_rows[keep], s_ids[keep]
    on = [h is not None for h in histories]
    factors = [
        [sp.repetition_penalty if o else 1.0 for sp, o in zip(params, on, strict=True)],
        [sp.frequency_penalty if o else 0.0 for sp, o in zip(params, on, strict=True)],
        [sp.presence_penalty if o else 0.0 for sp, o in zip(params, on, strict=True)],
    ]
    n_out, n_seen = len(o_ids), len(s_ids)
    pending_rows, pending_src = (pending[0], pending[1]) if pending is not None else ([], [])
    host = torch.cat(
        [
            torch.tensor(factors, dtype=torch.float64).view(torch.int64).reshape(-1),
            o_rows, o_ids, o_counts, s_rows, s_ids,
            torch.tensor(pending_rows + pending_src, dtype=torch.int64),
        ]
    )  # fmt: skip
    dev = to_device(host, logits.device)
    rep, freq, pres = dev[: 3 * num].view(torch.float64).float().view(3, num)
    idx = dev[3 * num :]
    counts = torch.zeros(num, vocab, dtype=torch.float32, device=logits.device)  # [S, V]
    counts.index_put_(
        (idx[:n_out], idx[n_out : 2 * n_out]), idx[2 * n_out : 3 * n_out].float(), accumulate=True
    )
    s0 = 3 * n_out
    if pending is not None and pending_rows:
        p0, n_pending = s0 + 2 * n_seen, len(pending_rows)
        rows = idx[p0 : p0 + n_pending]
        ids = pending[2].index_select(0, idx[p0 + n_pending :]).to(torch.int64)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    seen = counts > 0  # [S, V]
    seen[idx[s0 : s0 + n_seen], idx[s0 + n_seen : s0 + 2 * n_seen]] = True
    x = logits.to(torch.float32, copy=True)  # [S, V]
    r = rep[:, None].expand_as(x)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x -= freq[:, None] * counts + pres[:, None] * (counts > 0).float()
    return x


# -- the A/B ------------------------------------------------------------------------------------
def _to_device(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    return host.to(dev)


def formula(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """The [S, V] arithmetic both share, on state already built (the floor: on a GPU
    these are device kernels, not host work)."""
    rep, freq, pres = torch.tensor([[1.1], [0.2], [0.1]]).unbind(0)  # [1] each
    x = logits.to(torch.float32, copy=True)  # [S, V]
    r = rep[:, None].expand_as(x)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x -= freq[:, None] * counts + pres[:, None] * (counts > 0).float()
    return x


class DeviceOps(TorchDispatchMode):
    """Counts the aten ops that would run on a device (views excluded): on a GPU each
    is a kernel launch the host pays for."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def measure(rows: int, prompt_len: int, vocab: int, steps: int, seed: int = 0) -> dict:
    """ms per decode step of both and of the floor, median and mean (a step's time
    includes its ``add`` of one token per row)."""
    rng = random.Random(seed)
    params = [
        SamplingParams(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2,
                       presence_penalty=0.1, seed=i)
        for i in range(rows)
    ]  # fmt: skip
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(rows)]
    impls = {
        "old": ([OldPenaltyHistory(prompt_len) for _ in range(rows)], old_apply_penalties),
        "new": (
            [PenaltyHistory(prompt_len) for _ in range(rows)],
            functools.partial(apply_penalties, pool=PenaltyPool()),
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in (*impls, "floor")}
    ops: dict[str, int] = {}
    gen = torch.Generator().manual_seed(seed)
    tokens = prompts
    for step in range(steps + 1):
        logits = torch.randn(rows, vocab, generator=gen) * 3  # [S, V]
        got = {}
        order = list(impls) if step % 2 else list(reversed(impls))
        for name in order:
            hists, fn = impls[name]
            t0 = time.thread_time()
            for h, t in zip(hists, tokens, strict=True):
                h.add(t)
            if step == steps:  # the last step, once more with its ops counted (not timed)
                with DeviceOps() as counted:
                    got[name] = fn(logits, params, list(hists), None, _to_device)
                ops[name] = counted.count
            else:
                got[name] = fn(logits, params, list(hists), None, _to_device)
            times[name].append(time.thread_time() - t0)
        assert torch.equal(got["old"], got["new"]), f"step {step}: the logits differ"
        new_hists = impls["new"][0]
        counts = torch.stack([h.counts for h in new_hists])  # type: ignore[misc]  # [S, V]
        seen = torch.stack([h.in_prompt for h in new_hists]) | (counts > 0)  # type: ignore[misc]
        t0 = time.thread_time()
        formula(logits, counts, seen)
        times["floor"].append(time.thread_time() - t0)
        tokens = [[int(i)] for i in got["new"].argmax(dim=-1).tolist()]
    out: dict = {"rows": rows, "prompt": prompt_len, "vocab": vocab, "steps": steps}
    for name, ts in times.items():
        out[f"{name}_median_ms"] = round(1e3 * statistics.median(ts[1:]), 3)
        out[f"{name}_mean_ms"] = round(1e3 * statistics.fmean(ts[1:]), 3)
    out["old_ops"], out["new_ops"] = ops["old"], ops["new"]
    out["ratio_median"] = round(out["new_median_ms"] / out["old_median_ms"], 3)
    floor = out["floor_median_ms"]
    out["old_above_floor_ms"] = round(out["old_median_ms"] - floor, 3)
    out["new_above_floor_ms"] = round(out["new_median_ms"] - floor, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, nargs="+", default=[1000, 100_000])
    ap.add_argument("--vocab", type=int, default=128_256)  # Llama 3's
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    measure(args.rows, 100, 1000, 4)  # warm-up: each path's first calls
    results = []
    for n in args.prompt:
        r = measure(args.rows, n, args.vocab, args.steps)
        results.append(r)
        print(
            f"{r['rows']} rows x {n:6d}-token prompts, vocab {r['vocab']}: decode step "
            f"old {r['old_median_ms']:.3f} ms (mean {r['old_mean_ms']:.3f}), new "
            f"{r['new_median_ms']:.3f} ms (mean {r['new_mean_ms']:.3f}), new/old "
            f"{r['ratio_median']:.3f}x; above the [S, V] arithmetic ({r['floor_median_ms']:.3f}"
            f" ms): old {r['old_above_floor_ms']:.3f}, new {r['new_above_floor_ms']:.3f} ms; "
            f"device ops per step (launches on a GPU): old {r['old_ops']}, new {r['new_ops']}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
