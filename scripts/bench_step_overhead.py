#!/usr/bin/env python
"""Executor step overhead: the round trip of a near-empty step through the multiprocess
executor (pickle, pipes to every TP worker, each worker's connector hooks, the all-ranks
aggregation, back), at TP 1 and 2, with the tiny model on CPU (or ``--device cuda``);
at TP 1 also through the in-process executor (``--distributed-executor-backend uni``: no
pickle, no pipe), for the difference.

    python scripts/bench_step_overhead.py [--tp 1 2] [--backend mp uni] [--steps 2000] [--json F]

``empty``: a step with no tokens (what an engine sends its workers while only transfers
are pending); ``decode1``: one sequence decoding one token (the smallest real step; on
the tiny model the forward itself is ~0.1-1 ms, so this is mostly overhead too). Prints
p50/p99 in ms. The box is noisy: read p50, rerun for the spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(tp: int, steps: int, device: str, backend: str) -> dict[str, float | str]:
    cfg = EngineConfig(
        model=ModelConfig(model="tiny"),
        cache=CacheConfig(num_blocks=64),
        parallel=ParallelConfig(tp=tp, device=device, distributed_executor_backend=backend),  # type: ignore[arg-type]
    )
    core = EngineCore(cfg, log_level="WARNING")
    ex = core.executor
    greedy = SamplingParams(max_tokens=1, temperature=0)
    try:
        out: dict[str, float | str] = {"tp": tp, "backend": backend}
        for kind in ("empty", "decode1"):
            times = []
            for i in range(steps + 50):
                seqs = []
                if kind == "decode1":  # position 7 of a sequence in block 0
                    seqs = [ScheduledSeq("r", [5], 7, [0], greedy, samples=True)]
                sched = SchedulerOutput(step_id=i, seqs=seqs)
                t0 = time.perf_counter()
                ex.execute_model(sched)
                if i >= 50:  # warm-up
                    times.append((time.perf_counter() - t0) * 1000)
            out[f"{kind}_p50_ms"] = statistics.median(times)
            out[f"{kind}_p99_ms"] = _pct(times, 0.99)
        return out
    finally:
        core.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--backend", nargs="+", default=["mp", "uni"], choices=["mp", "uni"])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    runs = [(tp, b) for tp in args.tp for b in args.backend if b == "mp" or tp == 1]
    rows = [measure(tp, args.steps, args.device, b) for tp, b in runs]
    print("| TP | executor | empty step p50 / p99 ms | 1-token decode step p50 / p99 ms |")
    print("|---:|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['tp']} | {r['backend']} | {r['empty_p50_ms']:.3f} / {r['empty_p99_ms']:.3f} | "
            f"{r['decode1_p50_ms']:.3f} / {r['decode1_p99_ms']:.3f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
