"""``pd-bench offline``: throughput and latency of the engine itself (no HTTP).

Drives ``engine.llm.LLM``'s ``EngineCore`` step by step, so every request's first-token
and finish times are known to one step: random token-id prompts (seeded), greedy,
``ignore_eos`` so exactly ``--output-len`` tokens come out. A warm-up run with other
prompts of the same shape comes first (fresh prompts every run: the prefix cache never
turns a measured prefill into a cache hit).

``--compare-hf`` runs the same prompts through transformers ``generate`` (greedy, batch,
same dtype and device) in the same process after the engine is shut down, and prints the
throughput ratio and, in float32, whether the first prompt's tokens agree.

``--structured json|regex`` constrains every request's output (structured outputs,
llguidance; ``offline_structured.py``): each request its own small JSON schema or regex,
compiled before the clock starts. The batch runs twice, on an engine with
``--no-async-scheduling`` and one with async scheduling (the default: masks sent after
the forward started, ``DeferredSampling``), whatever the command line says, and the
report gives both and their ratio; every output that completed its grammar is checked
against it (an invalid one exits 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from engine.bench.hf_baseline import first_prompt_match, run_hf
from engine.bench.stats import Summary, json_safe
from engine.bench.structured_specs import (
    STRUCTURED_KINDS,
    STRUCTURED_OUTPUT_LEN,
    structured_output,
    structured_specs,
)
from engine.heap import freeze_startup_heap

WORKLOADS: dict[str, dict[str, int]] = {
    "throughput": {"num_prompts": 32, "input_len": 512, "output_len": 128},
    "latency": {"num_prompts": 1, "input_len": 512, "output_len": 128},
    "prefill": {"num_prompts": 1, "input_len": 8000, "output_len": 1},
}
DEFAULT_SHAPE = {"num_prompts": 8, "input_len": 128, "output_len": 32}


def add_offline_args(p: argparse.ArgumentParser) -> None:
    from engine.server.cli_args import add_config_args

    g = p.add_argument_group("workload options")
    g.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        help="preset shape: throughput 32x512->128, latency 1x512->128, prefill 1x8000->1 "
        "(explicit --num-prompts/--input-len/--output-len override it)",
    )
    g.add_argument("--num-prompts", type=int, help="prompts in the batch (default: 8)")
    g.add_argument("--input-len", type=int, help="prompt tokens per prompt (default: 128)")
    g.add_argument("--output-len", type=int, help="tokens generated per prompt (default: 32)")
    g.add_argument(
        "--prompt-seed", type=int, default=0, help="seed of the random prompts (default: 0)"
    )
    g.add_argument(
        "--token-id-range",
        type=int,
        nargs=2,
        metavar=("LO", "HI"),
        help="prompt token ids are drawn from [LO, HI) (default: [3, vocab size))",
    )
    g.add_argument(
        "--structured",
        choices=STRUCTURED_KINDS,
        help="constrain every output: json (each request its own schema: an object with an "
        "integer, an enum, a string and a boolean) or regex; runs the batch with "
        "--no-async-scheduling and with async scheduling and reports both (needs "
        f"llguidance; default --output-len {STRUCTURED_OUTPUT_LEN})",
    )
    g.add_argument("--num-warmup", type=int, default=1, help="warm-up runs (default: 1)")
    g.add_argument("--num-iters", type=int, default=1, help="measured runs (default: 1)")
    g.add_argument(
        "--compare-hf",
        action="store_true",
        help="also run transformers generate on the same prompts (--model must be a "
        "checkpoint directory) and print the ratio",
    )
    g.add_argument(
        "--matmul-peak",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the device's matmul peak (cuda only; default: on for --workload prefill)",
    )
    g.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    g.add_argument(
        "--log-level",
        type=str.upper,
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="engine log level (default: WARNING)",
    )
    add_config_args(p)


def resolve_shape(args: argparse.Namespace) -> dict[str, int]:
    shape = dict(WORKLOADS[args.workload] if args.workload else DEFAULT_SHAPE)
    if getattr(args, "structured", None) and not args.workload:
        shape["output_len"] = STRUCTURED_OUTPUT_LEN
    for k in shape:
        if getattr(args, k, None) is not None:
            shape[k] = getattr(args, k)
    for k, v in shape.items():
        if v < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {v}")
    return shape


def random_prompts(n: int, length: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


# ---------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------


def prefill_flops(arch: Any, n: int, logits_rows: int = 1) -> dict[str, float]:
    """FLOPs of one causal prefill of ``n`` tokens from an empty cache.

    Matmuls: 2 x (weights touched per token) x n for q/k/v/o and the MLP (embeddings are a
    lookup), plus the LM head for the ``logits_rows`` sampled positions. Attention: QK^T and
    PV, each 2 x head_dim FLOPs per (query, key) pair, n(n+1)/2 causal pairs per head and
    layer, i.e. about 2 x layers x heads x head_dim x n^2.
    """
    h, d = arch.hidden_size, arch.head_dim
    heads, kv = arch.num_attention_heads, arch.num_key_value_heads
    per_layer = h * d * (2 * heads + 2 * kv) + 3 * h * arch.intermediate_size
    linear = 2.0 * n * arch.num_hidden_layers * per_layer
    lm_head = 2.0 * logits_rows * h * arch.vocab_size
    attention = 2 * 2.0 * d * arch.num_hidden_layers * heads * n * (n + 1) / 2
    return {
        "linear": linear,
        "lm_head": lm_head,
        "attention": attention,
        "total": linear + lm_head + attention,
    }


def matmul_peak_flops(dtype_name: str, device: str, n: int = 8192, iters: int = 20) -> float:
    """Achieved FLOP/s of a large square ``torch.matmul`` (a practical peak)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    c = torch.empty(n, n, dtype=dtype, device=device)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        torch.matmul(a, b, out=c)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del a, b, c
    torch.cuda.empty_cache()
    return 2.0 * n**3 * iters / seconds


# ---------------------------------------------------------------------------------------
# Running the engine
# ---------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One batch through the engine. Times in seconds from the first ``add_request``."""

    elapsed: float
    prompt_tokens: int
    output_tokens: int
    ttft: list[float]
    e2e: list[float]
    tokens: list[list[int]] = field(repr=False)
    steps: int = 0
    finish_reasons: list[str | None] = field(default_factory=list, repr=False)

    def tpot(self) -> list[float]:
        return [
            (e - t) / (len(toks) - 1)
            for t, e, toks in zip(self.ttft, self.e2e, self.tokens, strict=True)
            if len(toks) > 1
        ]

    def numbers(self) -> dict[str, Any]:
        el = self.elapsed
        tpot = self.tpot()
        out: dict[str, Any] = {
            "elapsed_s": el,
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "requests_per_s": len(self.e2e) / el,
            "output_tokens_per_s": self.output_tokens / el,
            "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / el,
            "ttft_ms": Summary.of(self.ttft).scaled(1e3).to_dict(),
            "tpot_ms": Summary.of(tpot).scaled(1e3).to_dict(),
            "e2e_ms": Summary.of(self.e2e).scaled(1e3).to_dict(),
        }
        if len(self.e2e) == 1:
            out["single_ttft_ms"] = self.ttft[0] * 1e3
            out["ms_per_output_token"] = tpot[0] * 1e3 if tpot else None
            out["prefill_tokens_per_s"] = self.prompt_tokens / self.ttft[0]
        return out


class _Ids:
    n = 0

    @classmethod
    def next(cls) -> str:
        cls.n += 1
        return f"bench-{cls.n}"


def run_batch(
    core: Any,
    prompts: list[list[int]],
    output_len: int,
    structured: list[Any] | None = None,
) -> RunResult:
    """Add every prompt, step the engine until all finish; time each request's first token
    and finish (to the step that produced it). ``structured``: one ``StructuredOutput`` per
    prompt (compiled before the clock starts)."""
    from engine.core.request import Request
    from engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    sps = [sp] * len(prompts)
    if structured is not None:
        for so in structured:
            core.grammars.compile(so)
        sps = [dataclasses.replace(sp, structured_output=so) for so in structured]
    rids = [_Ids.next() for _ in prompts]
    index = {rid: i for i, rid in enumerate(rids)}
    tokens: list[list[int]] = [[] for _ in prompts]
    first: list[float | None] = [None] * len(prompts)
    done: list[float | None] = [None] * len(prompts)
    reasons: list[str | None] = [None] * len(prompts)
    remaining = len(prompts)
    steps = 0
    t0 = time.perf_counter()
    for rid, prompt, params in zip(rids, prompts, sps, strict=True):
        core.add_request(Request(rid, prompt, params))
    while remaining:
        if not core.has_work():
            raise RuntimeError("the engine has no work left but requests did not finish")
        outputs, _ = core.step()
        steps += 1
        now = time.perf_counter() - t0
        for out in outputs:
            i = index.get(out.request_id)
            if i is None:
                continue
            if out.new_token_ids:
                tokens[i].extend(out.new_token_ids)
                if first[i] is None:
                    first[i] = now
            if out.finished:
                if out.finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                done[i] = now
                reasons[i] = out.finish_reason
                remaining -= 1
    ttft = [f if f is not None else math.nan for f in first]
    e2e = [d if d is not None else math.nan for d in done]
    return RunResult(
        elapsed=max(e2e),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=sum(len(t) for t in tokens),
        ttft=ttft,
        e2e=e2e,
        tokens=tokens,
        steps=steps,
        finish_reasons=reasons,
    )


# ---------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------


def median_numbers(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-key median over measured runs of the top-level numbers (the last run's
    nested summaries)."""
    out = dict(runs[-1])
    for k, v in runs[-1].items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            vals = [r[k] for r in runs if isinstance(r.get(k), int | float)]
            out[k] = statistics.median(vals)
    return out


def fmt_number(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:{spec}}"


@dataclass
class EngineRun:
    """One engine's warm-up and measured runs (``run_engine``)."""

    dtype: str
    executor: str
    engine_start_s: float
    num_blocks: int | None
    arch: Any
    runs: list[dict[str, Any]]
    last: RunResult
    last_prompts: list[list[int]]
    step_split: dict[str, float] | None
    structured: list[Any] | None = None  # the last run's specs (--structured)

    def header(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "executor": self.executor,
            "engine_start_s": self.engine_start_s,
            "num_blocks": self.num_blocks,
        }


def run_engine(
    config: Any,
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    shape: dict[str, int],
    structured: str | None = None,
) -> EngineRun:
    """Start an engine, run the warm-up and measured batches, shut it down.
    ``structured``: a ``--structured`` kind, each request its own spec of it."""
    from engine.config import ConfigError
    from engine.llm import LLM

    n, in_len, out_len = shape["num_prompts"], shape["input_len"], shape["output_len"]

    def specs(seed: int) -> tuple[list[Any] | None, list[Any] | None]:
        if structured is None:
            return None, None
        raw = structured_specs(structured, n, seed)
        return raw, [structured_output(structured, spec) for spec in raw]

    t_start = time.perf_counter()
    try:
        llm = LLM(config, log_level=args.log_level)
    except ConfigError as e:  # what only the model or memory can judge (--tp, --num-blocks)
        parser.error(str(e))
    try:
        core = llm.core
        dtype = core.config.model.dtype  # resolved ("auto" -> a concrete dtype)
        executor = core.config.parallel.distributed_executor_backend  # auto, resolved by LLM
        engine_start_s = time.perf_counter() - t_start
        freeze_startup_heap("pd-bench offline")  # as a node does: no full GC mid-run
        vocab = core.arch.vocab_size
        lo, hi = args.token_id_range or (min(3, vocab - 1), vocab)
        if not 0 <= lo < hi <= vocab:
            parser.error(f"--token-id-range: need 0 <= LO < HI <= vocab size {vocab}")
        if in_len + out_len > core.max_model_len:
            parser.error(
                f"--input-len {in_len} + --output-len {out_len} exceed the model's context "
                f"length {core.max_model_len} (lower them or raise --max-model-len; past the model's "
                f"max_position_embeddings only with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)"
            )
        for w in range(args.num_warmup):
            seed = args.prompt_seed + 1_000_003 * (w + 1)
            run_batch(core, random_prompts(n, in_len, lo, hi, seed), out_len, specs(seed)[1])
        runs, last_prompts, last, raw = [], [], None, None
        step_base = dataclasses.replace(core.step_stats)
        for it in range(args.num_iters):
            seed = args.prompt_seed + 7919 * it
            prompts = random_prompts(n, in_len, lo, hi, seed)
            raw, sos = specs(seed)
            last = run_batch(core, prompts, out_len, sos)
            short = [i for i, t in enumerate(last.tokens) if len(t) != out_len]
            if short and structured is None:
                print(f"warning: {len(short)} requests did not produce {out_len} tokens")
            runs.append(last.numbers())
            last_prompts = prompts
        assert last is not None
        # Where a measured step's time went: the engine's host work, the executor, the worker.
        step_split = core.step_stats.per_step_ms(step_base)
        return EngineRun(
            dtype=dtype,
            executor=executor,
            engine_start_s=engine_start_s,
            num_blocks=getattr(core, "num_blocks", None),
            arch=core.arch,
            runs=runs,
            last=last,
            last_prompts=last_prompts,
            step_split=step_split,
            structured=raw,
        )
    finally:
        llm.shutdown()


def run_offline(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from engine.config import ConfigError
    from engine.server.cli_args import config_from_args

    try:
        shape = resolve_shape(args)
    except ValueError as e:
        parser.error(str(e))
    n, in_len, out_len = shape["num_prompts"], shape["input_len"], shape["output_len"]
    # One prefill step per prompt unless the user chose the token budget.
    if not hasattr(args, "max_num_batched_tokens") and in_len > 2048:
        args.max_num_batched_tokens = in_len
    if args.compare_hf and args.structured:
        parser.error("--compare-hf does not go with --structured")
    if args.compare_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("--compare-hf: transformers is not installed; skipping the comparison")
            args.compare_hf = False
    try:
        config = config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    if args.compare_hf and config.model.model == "tiny":
        print("--compare-hf: --model tiny is not a checkpoint directory; skipping the comparison")
        args.compare_hf = False
    device = config.parallel.device
    want_peak = args.matmul_peak if args.matmul_peak is not None else args.workload == "prefill"

    report: dict[str, Any] = {
        "command": "offline",
        "workload": args.workload,
        "shape": shape,
        "config": dataclasses.asdict(config),
    }
    print(
        f"pd-bench offline: {n} x {in_len} -> {out_len} tokens, model {config.model.model}, "
        f"device {device}, tp {config.parallel.tp}",
        flush=True,
    )
    if args.structured:
        from engine.bench.offline_structured import run_structured

        return run_structured(args, parser, config, shape, report)
    eng = run_engine(config, args, parser, shape)
    dtype, arch, executor, last, last_prompts = (
        eng.dtype, eng.arch, eng.executor, eng.last, eng.last_prompts
    )  # fmt: skip
    report.update(eng.header())
    result = median_numbers(eng.runs)
    report["iterations"] = eng.runs
    report["result"] = result
    report["step_ms"] = step_split = eng.step_split

    mode = "async" if config.scheduler.async_scheduling else "sync (--no-async-scheduling)"
    print(
        f"dtype {dtype}, executor {executor}, scheduling {mode}, {args.num_warmup} warm-up + "
        f"{args.num_iters} measured run(s)"
    )
    print(
        f"  elapsed                 {result['elapsed_s'] * 1e3:10.1f} ms  ({result['steps']} steps)"
    )
    print(f"  output throughput       {result['output_tokens_per_s']:10.1f} tok/s")
    print(f"  total throughput        {result['total_tokens_per_s']:10.1f} tok/s (prompt + output)")
    print(f"  requests                {result['requests_per_s']:10.2f} req/s")
    print(
        f"  TTFT mean/median        {fmt_number(result['ttft_ms']['mean'])} / "
        f"{fmt_number(result['ttft_ms']['median'])} ms"
    )
    print(f"  TPOT mean               {fmt_number(result['tpot_ms']['mean'], '.3f')} ms/token")
    if step_split:
        print(
            f"  per step (mean of {step_split['steps']:.0f})  schedule "
            f"{step_split['schedule_ms']:.3f} + executor {step_split['ipc_ms']:.3f} + worker "
            f"{step_split['worker_ms']:.3f} + update {step_split['update_ms']:.3f} ms"
        )
    if n == 1:
        print(f"  single-stream TTFT      {result['single_ttft_ms']:10.2f} ms")
        print(
            f"  ms per output token     {fmt_number(result['ms_per_output_token'], '10.3f')} (decode)"
        )
        print(f"  prefill                 {result['prefill_tokens_per_s']:10.1f} tok/s")
        flops = prefill_flops(arch, in_len)
        achieved = flops["total"] / (result["single_ttft_ms"] / 1e3)
        pre: dict[str, Any] = {
            "tokens": in_len,
            "flops": flops,
            "achieved_tflops": achieved / 1e12,
            "params_linear": int(flops["linear"] / (2 * in_len)),
        }
        print(
            f"  prefill compute         {achieved / 1e12:10.4g} TFLOP/s "
            f"({flops['total'] / 1e12:.4g} TFLOP: linear {flops['linear'] / 1e12:.4g}, "
            f"attention {flops['attention'] / 1e12:.4g}, LM head {flops['lm_head'] / 1e12:.4g})"
        )
        if want_peak and device == "cuda":
            peak = matmul_peak_flops(dtype, "cuda")
            pre["matmul_peak_tflops"] = peak / 1e12
            pre["fraction_of_peak"] = achieved / peak
            print(
                f"  {dtype} matmul peak     {peak / 1e12:10.1f} TFLOP/s (measured) -> "
                f"prefill at {100 * achieved / peak:.1f}% of peak"
            )
        elif want_peak:
            print("  matmul peak             n/a (measured on cuda only)")
        report["prefill"] = pre

    if args.compare_hf:
        threads = config.parallel.worker_threads * config.parallel.tp
        print(f"transformers generate on the same {n} prompts ...", flush=True)
        hf = run_hf(config.model.model, dtype, device, last_prompts, out_len, threads)
        ratio = result["output_tokens_per_s"] / hf["output_tokens_per_s"]
        match = first_prompt_match(last.tokens[0], hf["tokens"][0])
        hf_tokens = hf.pop("tokens")
        report["hf"] = {**hf, "speedup": ratio, "first_prompt": match}
        report["hf"]["first_prompt_tokens"] = hf_tokens[0]
        report["first_prompt_tokens"] = last.tokens[0]
        where = f" ({hf['threads']} threads)" if hf["threads"] else ""
        print(f"  transformers            {hf['output_tokens_per_s']:10.1f} tok/s output{where}")
        print(f"  pdserve / transformers  {ratio:10.2f}x")
        if dtype == "float32":
            print(
                f"  first prompt tokens equal: {match['equal']} "
                f"({match['matching_prefix']}/{match['length']} leading tokens match)"
            )
        else:
            print(
                f"  first prompt tokens: {match['matching_prefix']}/{match['length']} leading "
                f"tokens match (not checked for equality in {dtype})"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(json_safe(report), f, indent=2)
        print(f"wrote {args.json}")
    sys.stdout.flush()
    return 0
