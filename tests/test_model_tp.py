"""TP=2 (two gloo processes, each with its own KV cache shard) matches TP=1, and so does
TP=4 on models with 2 KV heads (each rank holds one replicated KV head)."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import torch
from harness import child_context, child_process, free_port
from hf_models import make_hf_model, random_prompt, save_hf_model
from paged_runner import PagedRunner, tp_greedy_worker

from engine.model.loader import load_model

pytestmark = pytest.mark.slow  # TP ranks in child processes

TP = 2
MAX_NEW_TOKENS = 24
RESULT_TIMEOUT_S = 120.0


def _run_tp(jobs: list[tuple[str, list[list[int]], int]], tp: int = TP) -> list:
    """Run ``jobs`` on ``tp`` ranks in child processes; return rank 0's results."""
    results_q = child_context().Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        child_process(tp_greedy_worker, rank, tp, init_method, jobs, results_q)
        for rank in range(tp)
    ]
    try:
        for p in procs:
            p.start()
        by_rank: dict[int, object] = {}
        for _ in range(tp):
            try:
                rank, payload = results_q.get(timeout=RESULT_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"TP workers gave no result within {RESULT_TIMEOUT_S}s")
            if isinstance(payload, str):
                pytest.fail(f"TP rank {rank} failed:\n{payload}")
            by_rank[rank] = payload
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0, f"worker exit code {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    # Every rank computes the full-vocab logits, so all ranks must agree.
    for rank in range(1, tp):
        for job0, job_r in zip(by_rank[0], by_rank[rank], strict=True):
            assert job0[0] == job_r[0], f"rank {rank} tokens differ from rank 0"
    return by_rank[0]  # type: ignore[return-value]


def _tp1(model: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    net, cfg = load_model(model)
    runner = PagedRunner(net, cfg, num_blocks=64, block_size=16)
    tokens, logits = [], []
    for i, prompt in enumerate(prompts):
        toks, rows = runner.greedy(i, prompt, MAX_NEW_TOKENS)
        tokens.append(toks)
        logits.append(rows)
    return tokens, logits


@pytest.mark.timeout(240)
def test_tp2_matches_tp1(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    ckpt = save_hf_model(make_hf_model("qwen2"), tmp_path / "qwen2", max_shard_size="100KB")
    jobs = [
        (ckpt, [random_prompt(n, 256, seed=n) for n in (5, 17, 40)], MAX_NEW_TOKENS),
        ("tiny", [list(b"The quick brown fox"), list(range(40, 90))], MAX_NEW_TOKENS),
    ]
    tp2 = _run_tp(jobs)
    for (model, prompts, _), (tp2_tokens, tp2_logits) in zip(jobs, tp2, strict=True):
        tp1_tokens, tp1_logits = _tp1(model, prompts)
        assert tp2_tokens == tp1_tokens, model
        for ref, got in zip(tp1_logits, tp2_logits, strict=True):
            atol = 1e-4 * max(1.0, float(ref.abs().max()))
            assert torch.allclose(torch.from_numpy(got), ref, atol=atol, rtol=0), model


@pytest.mark.timeout(300)
def test_tp4_replicated_kv_heads_matches_tp1(tmp_path: Path) -> None:
    """TP 4 on models with 2 KV heads (4 query heads): ranks 0-1 hold KV head 0, ranks 2-3
    KV head 1 (``kv_head_range``), each with its own one-head KV cache; greedy tokens and
    logits match TP=1. Qwen2 has k/v biases, so the replicated bias rows are checked too."""
    pytest.importorskip("transformers")
    ckpt = save_hf_model(make_hf_model("qwen2"), tmp_path / "qwen2", max_shard_size="100KB")
    jobs = [
        (ckpt, [random_prompt(n, 256, seed=n) for n in (5, 17, 40)], MAX_NEW_TOKENS),
        ("tiny", [list(b"The quick brown fox"), list(range(40, 90))], MAX_NEW_TOKENS),
    ]
    tp4 = _run_tp(jobs, tp=4)
    for (model, prompts, _), (tp4_tokens, tp4_logits) in zip(jobs, tp4, strict=True):
        tp1_tokens, tp1_logits = _tp1(model, prompts)
        assert tp4_tokens == tp1_tokens, model
        for ref, got in zip(tp1_logits, tp4_logits, strict=True):
            atol = 1e-4 * max(1.0, float(ref.abs().max()))
            assert torch.allclose(torch.from_numpy(got), ref, atol=atol, rtol=0), model
