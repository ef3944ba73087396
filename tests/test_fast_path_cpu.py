"""The GPU fast path checked on CPU: the Triton backend under Triton's interpreter inside the
real engine, and the padded static-buffer decode path that CUDA graphs replay.

What only a GPU can check (compiled kernels, graph capture and replay, speed) is in
``tests/test_gpu.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.model.attention import pack_step  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.worker.cuda_graphs import DecodeGraphs, decode_buckets  # noqa: E402

BS = 16


def test_decode_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    for n in range(1, 65):
        graphs_bucket = next(b for b in decode_buckets(64) if b >= n)
        assert graphs_bucket - n < 8


def test_padded_decode_buffers_give_the_eager_rows_and_write_no_padding_slot():
    net, cfg = load_model("tiny", attention_backend="triton")
    from engine.kv_cache_layout import KVCacheSpec

    spec = KVCacheSpec(
        32, cfg.num_hidden_layers, cfg.num_key_value_heads, BS, cfg.head_dim, torch.float32
    )
    cache = spec.allocate()
    prompts = [[3, 4, 5, 6, 7], list(range(10, 30)), [9]]
    tables = [[1], [2, 3], [4]]
    prefill = pack_step(prompts, [0, 0, 0], tables, BS).to_device(torch.device("cpu"))
    net(prefill.input_ids, prefill.positions, prefill.attn, cache)

    step = ([[11], [12], [13]], [5, 20, 1], tables)  # one decode token each
    eager_cache = cache.clone()
    eager = pack_step(*step, BS).to_device(torch.device("cpu"))
    want = net(eager.input_ids, eager.positions, eager.attn, eager_cache)  # [3, H]

    graphs = DecodeGraphs(
        net, cache, BS, width=8, max_num_seqs=8, device=torch.device("cpu"), capture=False
    )
    assert graphs.can_run(step[0]) and graphs.bucket_for(3) == 4
    packed, hidden = graphs.run(*step)
    assert hidden.shape[0] == 4 and packed.num_seqs == 4  # one padding sequence
    torch.testing.assert_close(hidden[:3], want, rtol=1e-4, atol=1e-4)
    # The padding sequence wrote nothing: both caches hold the same bytes.
    torch.testing.assert_close(cache, eager_cache, rtol=0, atol=1e-5)
    assert not graphs.can_run([[1, 2]])  # a prefill never takes the graph path


@pytest.mark.slow
def test_engine_on_the_triton_backend_matches_the_reference_backend(monkeypatch):
    """Chunked prefill, prefix-cache hits and decode batches, through real workers; the
    Triton attention alone and with the Triton model ops (``PDSERVE_MODEL_OPS=triton``)."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    prompts = [list(range(1, 41)), list(range(1, 41)) + [7, 8], [5] * 3, list(range(50, 70))]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    out = {}
    # The Triton attention with the torch ops (the default), and with the Triton ops.
    for backend, ops in (("reference", ""), ("triton", ""), ("triton", "triton")):
        monkeypatch.setenv("PDSERVE_MODEL_OPS", ops)
        cfg = EngineConfig(
            model=ModelConfig(attention_backend=backend),
            cache=CacheConfig(num_blocks=64, block_size=BS),
            scheduler=SchedulerConfig(max_num_batched_tokens=32),
        )
        with LLM(cfg) as llm:
            first = llm.generate_token_ids(prompts, params)
            # Full-block prefixes are cached now.
            again = llm.generate_token_ids(prompts[:2], params)
            computed = llm.stats()["prompt_tokens_total"]
        assert computed < sum(len(p) for p in prompts + prompts[:2]) - 2 * BS
        out[backend, ops] = first + again
    assert out["triton", ""] == out["reference", ""]
    assert out["triton", "triton"] == out["reference", ""]
