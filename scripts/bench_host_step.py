#!/usr/bin/env python
"""The host work per decode step at a given batch, without a model: the real scheduler's
``schedule()``, the step message's pickling both ways (what the executor sends every
rank), a rank's preparation of the forward (its request states updated, the step packed
into the one buffer it copies to the device), and ``update_from_output()`` fed one
sampled token per sequence.

On a GPU this is time the device waits for (no step overlaps the next yet), and it grows
with the batch: the number to watch at high concurrency.

    python scripts/bench_host_step.py --seqs 32 256 --context 512 2000 [--json F]

Prints ms per step for each (seqs, context) after the prompts are in; the box is noisy:
compare variants in one run.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine.core.request import Request  # noqa: E402
from engine.core.scheduler import Scheduler  # noqa: E402
from engine.core.scheduler_output import ModelRunnerOutput  # noqa: E402
from engine.heap import freeze_startup_heap  # noqa: E402
from engine.model.attention import pack_step  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.worker.request_states import RequestStates  # noqa: E402
from kvconnector.noop import NoopConnectorScheduler  # noqa: E402


def measure(seqs: int, context: int, steps: int, block_size: int = 16) -> dict[str, float]:
    budget = max(8192, seqs)
    # Requests whose prompts went in first decode while later prompts go in: none may end
    # before the measured steps.
    max_tokens = steps + 8 + 2 * (seqs * context // budget + seqs) + 64
    max_len = context + max_tokens
    num_blocks = seqs * (max_len // block_size + 2) + 8
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=max_len, dtype="float32"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget),
    )
    sched = Scheduler(cfg, num_blocks, max_len, NoopConnectorScheduler(cfg, None))  # type: ignore[arg-type]
    for i in range(seqs):  # each its own parameters, as from clients
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=i)
        prompt = [(i * 7 + j) % 500 for j in range(context)]
        sched.add_request(Request(f"cmpl-{i:032x}", prompt, params))

    states = RequestStates()  # one rank's

    def step() -> tuple[float, float, float, float, int]:
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        raw = pickle.dumps(so)
        got = pickle.loads(raw)
        t2 = time.perf_counter()
        states.update(got)
        seqs = got.seqs
        pack_step(
            [s.token_ids for s in seqs],
            [s.start_pos for s in seqs],
            [states.block_ids(s.request_id) for s in seqs],
            block_size,
        )
        t3 = time.perf_counter()
        sampled = {q.request_id: 5 for q in so.seqs if q.samples}
        sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))
        return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, len(raw)

    while sched.waiting or any(r.num_computed_tokens < context for r in sched.running):
        step()  # the prompts
    for _ in range(8):
        step()
    runs = [step() for _ in range(steps)]
    assert len(sched.running) == seqs and not sched.waiting, "every sequence decodes"
    ms = [1e3 * sum(r[k] for r in runs) / len(runs) for k in range(4)]
    return {
        "seqs": seqs,
        "context": context,
        "schedule_ms": round(ms[0], 4),
        "pickle_ms": round(ms[1], 4),
        "worker_prep_ms": round(ms[2], 4),
        "update_ms": round(ms[3], 4),
        "total_ms": round(sum(ms), 4),
        "message_bytes": runs[-1][4],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2000])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    freeze_startup_heap("bench")  # as a node does at start-up (engine/heap.py)
    results = []
    for n in args.seqs:
        for ctx in args.context:
            r = measure(n, ctx, args.steps)
            results.append(r)
            print(
                f"{n:4d} seqs x {ctx:5d} tokens: schedule {r['schedule_ms']:.3f} + pickle "
                f"{r['pickle_ms']:.3f} + worker prep {r['worker_prep_ms']:.3f} + update "
                f"{r['update_ms']:.3f} = {r['total_ms']:.3f} ms/step, "
                f"message {r['message_bytes']} B",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
