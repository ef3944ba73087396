#!/usr/bin/env python
"""A/B of requests arriving together with one prompt (``n`` choices): the scheduler's
wait for a shared prefix another request computes (``MIN_SHARED_PREFIX_TOKENS``, "on")
against each request computing it (the threshold out of reach, "off").

One offline engine (the tiny model unless ``--model``), rounds alternating on/off, a
fresh random prompt each round (no hit from an earlier round); wall time of
``generate([prompt] * n)`` and the prompt tokens the engine computed.

    python scripts/bench_shared_prefix.py --prompt-len 1500 --n 4 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import engine.core.scheduler as scheduler
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt-len", type=int, default=1500)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    on_threshold = scheduler.MIN_SHARED_PREFIX_TOKENS
    rng = random.Random(0)
    cfg = EngineConfig(model=ModelConfig(model=args.model), cache=CacheConfig(num_blocks=2048))
    times: dict[str, list[float]] = {"on": [], "off": []}
    tokens: dict[str, list[float]] = {"on": [], "off": []}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1)
    with LLM(cfg) as llm:
        for _ in range(args.rounds):
            for mode in ("on", "off"):
                scheduler.MIN_SHARED_PREFIX_TOKENS = on_threshold if mode == "on" else 1 << 62
                prompt = [rng.randint(1, 255) for _ in range(args.prompt_len)]
                before = llm.stats()["prompt_tokens_total"]
                t = time.perf_counter()
                llm.generate_token_ids([prompt] * args.n, params)
                times[mode].append(time.perf_counter() - t)
                tokens[mode].append(llm.stats()["prompt_tokens_total"] - before)
    for mode in ("on", "off"):
        print(
            f"{mode:>3}: wall s {[round(x, 3) for x in times[mode]]}, "
            f"prompt tokens computed {tokens[mode]}"
        )
    ratio = statistics.median(times["on"]) / statistics.median(times["off"])
    print(f"on/off wall time (medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
