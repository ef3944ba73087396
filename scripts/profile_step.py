"""Profile one TP rank's steps in-process: a prefill step and decode steps (graphs and eager).

Runs the real ``ModelRunner`` (packing, forward, sampling) without the engine loop or the
executor, so what it prints is the worker's share of a step. Prints milliseconds per step
and, with ``--trace``, the torch profiler's top kernels, writing a Chrome trace.

    python scripts/profile_step.py --model /tmp/llama-886m --device cuda --batch 32 \\
        --context 512 --trace /tmp/out
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.core.kv_cache_manager import cdiv
from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.model.config import load_arch_config, resolve_dtype
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import ModelRunner


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=32, help="decode batch size")
    ap.add_argument("--context", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="tokens in the prefill step")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--trace", metavar="DIR", help="torch profiler: top kernels + Chrome trace")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    arch = load_arch_config(args.model)
    dtype = resolve_dtype(args.dtype, args.device, arch)
    bs = 16
    per_seq = cdiv(args.context + args.iters + 8, bs)
    num_blocks = args.batch * per_seq + cdiv(args.prefill_tokens, bs) + 1
    cfg = EngineConfig(
        model=ModelConfig(model=args.model, dtype=dtype, enforce_eager=args.enforce_eager),
        cache=CacheConfig(block_size=bs, num_blocks=num_blocks),
        parallel=ParallelConfig(device=args.device),
        scheduler=SchedulerConfig(
            max_num_seqs=max(args.batch, 1), max_num_batched_tokens=args.prefill_tokens
        ),
    )
    runner = ModelRunner(cfg, 0, 1, args.device)
    t0 = time.perf_counter()
    runner.init_kv_cache(num_blocks)
    init_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(args.batch)]

    def run(sched: SchedulerOutput) -> None:  # what a worker does with a step
        runner.update_states(sched)
        runner.execute(sched)

    # Fill every sequence's context (prefill steps of up to --prefill-tokens tokens).
    step_id = 0
    for i in range(args.batch):
        for start in range(0, args.context, args.prefill_tokens):
            n = min(args.prefill_tokens, args.context - start)
            seq = ScheduledSeq(f"r{i}", [1] * n, start, tables[i], greedy, samples=True)
            run(SchedulerOutput(step_id, [seq]))
            step_id += 1

    prefill_blocks = list(range(1 + args.batch * per_seq, num_blocks))

    def prefill_step() -> None:
        seq = ScheduledSeq("p", [2] * args.prefill_tokens, 0, prefill_blocks, greedy, samples=True)
        run(SchedulerOutput(0, [seq]))

    pos = [args.context] * args.batch

    def decode_step() -> None:
        seqs = [
            ScheduledSeq(f"r{i}", [3], pos[i], tables[i], greedy, samples=True)
            for i in range(args.batch)
        ]
        run(SchedulerOutput(0, seqs))
        for i in range(args.batch):
            pos[i] = min(pos[i] + 1, per_seq * bs - 1)

    def timed(fn, iters: int) -> float:
        fn()
        _sync(args.device)
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(args.device)
        return (time.perf_counter() - t) / iters * 1000

    result = {
        "model": args.model,
        "device": args.device,
        "dtype": dtype,
        "graphs": runner.graphs is not None,
        "kv_init_and_capture_s": round(init_s, 2),
        "prefill_tokens": args.prefill_tokens,
        "prefill_ms": round(timed(prefill_step, max(2, args.iters // 4)), 3),
        "decode_batch": args.batch,
        "decode_context": args.context,
        "decode_step_ms": round(timed(decode_step, args.iters), 3),
    }
    result["prefill_tok_s"] = round(args.prefill_tokens / result["prefill_ms"] * 1000)
    result["decode_tok_s"] = round(args.batch / result["decode_step_ms"] * 1000)
    print(json.dumps(result, indent=2))
    if args.json:  # before the profiler: a trace that fails (CUPTI) keeps the timings
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)

    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        os.makedirs(args.trace, exist_ok=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        sort = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
        for name, fn, n in (("decode", decode_step, 5), ("prefill", prefill_step, 1)):
            with profile(activities=acts) as prof:
                for _ in range(n):
                    fn()
                _sync(args.device)
            print(f"== {name}: top 15 by {sort} ==")
            print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))
            prof.export_chrome_trace(os.path.join(args.trace, f"trace_{name}.json"))


if __name__ == "__main__":
    main()
