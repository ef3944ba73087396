"""``pd-bench offline --structured json|regex``: the same constrained batch (each request its
own grammar, ``structured_specs``) on an engine with ``--no-async-scheduling``, then one
with async scheduling (the default); both reported, with their ratio, and every output
that completed its grammar checked against it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from engine.bench.offline import fmt_number, median_numbers, run_engine
from engine.bench.stats import json_safe, ratio
from engine.bench.structured_specs import structured_error


def run_structured(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    config: Any,
    shape: dict[str, int],
    report: dict[str, Any],
) -> int:
    """``--structured``: the same constrained batch on an engine with
    ``--no-async-scheduling``, then one with async scheduling; both reported, with their
    ratio. Exit 1 when an output that completed its grammar does not follow it."""
    from engine.structured.compiler import import_llguidance
    from engine.tokenizer import load_tokenizer

    kind = args.structured
    try:
        import_llguidance("--structured")
    except ValueError as e:
        parser.error(str(e))
    tokenizer = load_tokenizer(config.model.model)
    modes: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    bad: list[str] = []
    last_specs: list[Any] = []
    for mode, flag in (("sync", False), ("async", True)):
        cfg = config.replace(scheduler=dataclasses.replace(config.scheduler, async_scheduling=flag))
        eng = run_engine(cfg, args, parser, shape, kind)
        if "dtype" not in report:
            report.update(eng.header())
        specs = eng.structured or []
        reasons = eng.last.finish_reasons
        complete = [i for i, r in enumerate(reasons) if r == "stop"]
        invalid = []
        for i in complete:
            why = structured_error(kind, specs[i], tokenizer.decode(eng.last.tokens[i]))
            if why is not None:
                invalid.append(f"{mode} request {i}: {why}")
        bad += invalid
        result = median_numbers(eng.runs)
        modes[mode] = {
            "result": result,
            "iterations": eng.runs,
            "step_ms": eng.step_split,
            "engine_start_s": eng.engine_start_s,
            "requests": len(reasons),
            "complete": len(complete),
            "valid": len(complete) - len(invalid),
            "cut_by_max_tokens": sum(r == "length" for r in reasons),
        }
        modes[mode]["outputs"] = [tokenizer.decode(t) for t in eng.last.tokens]
        outputs[mode] = eng.last.tokens
        last_specs = specs  # the last measured run's, one per request (both modes alike)
    sync, asyn = modes["sync"]["result"], modes["async"]["result"]

    ms = {m: modes[m]["result"]["tpot_ms"]["mean"] for m in modes}
    same = sum(a == b for a, b in zip(outputs["sync"], outputs["async"], strict=True))
    report["structured"] = {
        "kind": kind,
        **modes,
        "async_over_sync": {
            "output_tokens_per_s": ratio(asyn["output_tokens_per_s"], sync["output_tokens_per_s"]),
            "ms_per_output_token": ratio(ms["async"], ms["sync"]),
        },
        "same_tokens": same,
        "specs": last_specs,
    }
    report["result"] = sync  # the synchronous run's, as without --structured
    report["step_ms"] = modes["sync"]["step_ms"]
    r = report["structured"]["async_over_sync"]
    n = shape["num_prompts"]
    print(
        f"structured {kind}: each request its own {'schema' if kind == 'json' else 'regex'}; "
        f"{args.num_warmup} warm-up + {args.num_iters} measured run(s) per engine"
    )
    print(f"  {'':26}{'sync':>10}{'async':>10}{'async/sync':>12}")
    print(
        f"  {'output tok/s':26}{sync['output_tokens_per_s']:10.1f}"
        f"{asyn['output_tokens_per_s']:10.1f}{fmt_number(r['output_tokens_per_s'], '11.2f')}x"
    )
    print(
        f"  {'ms/token (TPOT mean)':26}{fmt_number(ms['sync'], '10.3f')}{fmt_number(ms['async'], '10.3f')}"
        f"{fmt_number(r['ms_per_output_token'], '11.2f')}x"
    )
    print(f"  {'elapsed ms':26}{sync['elapsed_s'] * 1e3:10.1f}{asyn['elapsed_s'] * 1e3:10.1f}")
    for key, label in (
        ("valid", "complete and valid"),
        ("cut_by_max_tokens", "cut by --output-len"),
    ):
        print(f"  {label:26}{modes['sync'][key]:>7}/{n:<2}{modes['async'][key]:>7}/{n:<2}")
    print(f"  async tokens equal to sync's: {same}/{n}")
    print(f"  example output: {modes['sync']['outputs'][0][:100]!r}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(json_safe(report), f, indent=2)
        print(f"wrote {args.json}")
    for b in bad:
        print(f"error: an output does not follow its structured output: {b}")
    sys.stdout.flush()
    return 1 if bad else 0
