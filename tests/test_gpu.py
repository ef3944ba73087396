"""Correctness on a CUDA GPU: the fast path (Triton attention, CUDA-graph decode, device
sampling, VRAM KV push) against transformers and against the reference backend.

Marked ``gpu``; skipped with a reason where no CUDA device is visible. ``scripts/gpu_check.sh``
runs them on the GPU host.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_models import hf_greedy, make_hf_model, random_prompt, save_hf_model

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]

LENGTHS = [1, 15, 16, 17, 300, 990]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


def _config(path: str, **model: object) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=path, **{"dtype": "float32", **model}),  # type: ignore[arg-type]
        cache=CacheConfig(num_blocks=1024),
        parallel=ParallelConfig(device="cuda"),
    )


_CHECKPOINTS: dict[str, dict] = {}


def _checkpoint(name: str, tmp_path_factory) -> dict:
    """A random checkpoint of ``name``, its prompts and transformers' greedy tokens (fp32,
    on the CPU); made once per module."""
    if name not in _CHECKPOINTS:
        model = make_hf_model(name, seed=0)
        path = save_hf_model(model, tmp_path_factory.mktemp("ckpt") / name)
        prompts = [random_prompt(n, 256, seed=n) for n in LENGTHS]
        hf = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
        _CHECKPOINTS[name] = {"path": path, "prompts": prompts, "hf": hf}
    return _CHECKPOINTS[name]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory) -> dict:
    return _checkpoint(request.param, tmp_path_factory)


# The engine-level checks below run on Llama only: each engine start costs seconds of the
# GPU run's few minutes, and what they check (graphs, backends, the VRAM push) does not
# depend on the architecture; Qwen2 is checked against transformers above.
@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict:
    return _checkpoint("llama", tmp_path_factory)


def test_fp32_greedy_with_graphs_matches_transformers(checkpoint):
    with LLM(_config(checkpoint["path"])) as llm:
        assert llm.core.config.model.attention_backend == "auto"
        out = llm.generate_token_ids(checkpoint["prompts"], GREEDY)
    assert out == checkpoint["hf"]


def test_cuda_graph_decode_is_token_identical_to_eager_and_async(llama):
    # 24 prompts: decode batches of 24 down to 1 replay padded buckets.
    prompts = [random_prompt(5 + 7 * i, 256, seed=100 + i) for i in range(24)]
    params = [SamplingParams(max_tokens=8 + i, temperature=0.0) for i in range(24)]
    sync = SchedulerConfig(async_scheduling=False)  # eager and graphs, then graphs async
    with LLM(_config(llama["path"], enforce_eager=True).replace(scheduler=sync)) as llm:
        eager = llm.generate_token_ids(prompts, params)
    # Two-token bad words (a pair each request's eager answer holds): under async
    # scheduling their bans follow the token in flight, so those steps go out with
    # ``sampling_deferred`` and sample on the in-process executor's step thread.
    banned = [
        dataclasses.replace(sp, bad_words_token_ids=(tuple(out[2:4]),))
        for sp, out in zip(params, eager, strict=True)
    ]
    with LLM(_config(llama["path"]).replace(scheduler=sync)) as llm:
        graphs = llm.generate_token_ids(prompts, params)
        graphs_banned = llm.generate_token_ids(prompts, banned)
    assert graphs == eager
    assert graphs_banned != eager
    # Graphs with async scheduling: each replay's input is the token the step before
    # sampled (filled in on the worker), decoded while the engine updates.
    cfg = _config(llama["path"])
    cfg = cfg.replace(scheduler=dataclasses.replace(cfg.scheduler, async_scheduling=True))
    with LLM(cfg) as llm:
        assert llm.generate_token_ids(prompts, params) == eager
        assert llm.generate_token_ids(prompts, banned) == graphs_banned


def test_triton_engine_matches_reference_with_chunks_prefix_hits_and_preemption(llama):
    """Chunked prefill, prefix-cache hits and preemption under both backends (fp32)."""
    prompts = llama["prompts"] + llama["prompts"][:3]  # repeats hit the cache
    base = _config(llama["path"])
    tight = dataclasses.replace(
        base,
        cache=CacheConfig(
            num_blocks=72
        ),  # the 990-token prompt needs 64: others wait or are preempted
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
    )
    results = {}
    for backend in ("reference", "triton"):
        cfg = tight.replace(model=dataclasses.replace(tight.model, attention_backend=backend))
        with LLM(cfg) as llm:
            results[backend] = llm.generate_token_ids(prompts, GREEDY)
            stats = llm.stats()
            # A prompt that fills the context (echo with max_tokens 0 sends one): its one
            # token, from a forward over every block of the cache's longest table.
            full = random_prompt(llm.core.scheduler.max_model_len, 256, seed=7)
            one = SamplingParams(max_tokens=1, temperature=0.0)
            results[backend + " full"] = llm.generate_token_ids([full], one)
        assert stats["num_preemptions_total"] > 0, "the test should exercise preemption"
    assert len(results["triton full"][0]) == 1
    assert results["triton full"] == results["reference full"]
    assert results["triton"] == results["reference"]
    assert results["triton"][: len(LENGTHS)] == llama["hf"]


def test_bf16_triton_logits_within_tolerance_of_reference_on_mixed_batches():
    from paged_runner import PagedRunner

    from engine.model.loader import load_model

    runs = {}
    for backend in ("reference", "triton"):
        net, cfg = load_model(
            "tiny", dtype=torch.bfloat16, device="cuda", attention_backend=backend
        )
        runner = PagedRunner(net, cfg, 256, dtype=torch.bfloat16, device="cuda")
        for seq in range(4):
            runner.add_sequence(seq)
        steps = [
            {0: random_prompt(40, 256, 1), 1: random_prompt(17, 256, 2)},  # two prefills
            {0: [5], 1: random_prompt(30, 256, 3), 2: random_prompt(5, 256, 4)},  # mixed
            {0: [6], 1: [7], 2: random_prompt(64, 256, 5), 3: [9]},  # chunk + decodes
            {0: [8], 1: [9], 2: [10], 3: [11]},  # decodes only
        ]
        runs[backend] = [runner.step(s) for s in steps]
    for ref_step, fast_step in zip(runs["reference"], runs["triton"], strict=True):
        for seq, ref in ref_step.items():
            fast = fast_step[seq]
            scale = ref.abs().max().item()
            assert (fast - ref).abs().max().item() <= 0.02 * scale + 0.02, seq


def test_sampler_noise_is_the_same_on_gpu_and_cpu():
    from engine.worker.sampler import hashed_uniform, position_seed

    keys = torch.tensor([position_seed(s, 11) for s in range(32)])
    assert torch.equal(hashed_uniform(keys, 1000), hashed_uniform(keys.cuda(), 1000).cpu())


def test_pd_over_nixl_vram_matches_colocated(llama):
    """P/D equals transformers' greedy tokens, which the colocated engine equals
    (``test_fp32_greedy_with_graphs_matches_transformers``)."""
    pytest.importorskip("nixl._api")
    from pd_utils import disagg_generate, nixl_config

    from engine.engine_core import EngineCore

    base = _config(llama["path"])
    p = EngineCore(nixl_config(base, "producer"))
    d = EngineCore(nixl_config(base, "consumer"))
    try:
        res = disagg_generate(p, d, llama["prompts"], GREEDY)
        assert res["tokens"] == llama["hf"]
        assert d.stats()["prompt_tokens_total"] == 0  # D computed no prompt token
        assert p.stats()["kv_bytes_sent_total"] > 0
    finally:
        p.shutdown()
        d.shutdown()


def test_the_triton_forward_of_a_mixed_step_never_synchronizes_with_the_host():
    """What ``tests/test_no_host_sync.py`` checks on CPU by the calls made, checked here by
    CUDA itself: any synchronizing call inside the forward raises."""
    from engine.kv_cache_layout import KVCacheSpec
    from engine.model.attention import pack_step
    from engine.model.loader import load_model

    dev = torch.device("cuda")
    net, cfg = load_model("tiny", dtype=torch.bfloat16, device="cuda", attention_backend="triton")
    cache = KVCacheSpec(
        32, cfg.num_hidden_layers, cfg.num_key_value_heads, 16, cfg.head_dim, torch.bfloat16
    ).allocate(dev)
    first = pack_step([list(range(1, 21)), [5, 6, 7]], [0, 0], [[1, 2], [3]], 16).to_device(dev)
    net(first.input_ids, first.positions, first.attn, cache)  # compiles the kernels
    tokens = [[30], [8], list(range(40, 52)), list(range(60, 70))]
    step = pack_step(tokens, [20, 3, 0, 20], [[1, 2], [3], [4], [5, 6]], 16).to_device(dev)
    rows = torch.tensor([0, 1, 13, 23], device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hidden = net(step.input_ids, step.positions, step.attn, cache)
        net.compute_logits(hidden[rows])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_an_async_decode_step_launches_while_the_step_before_it_runs():
    """Async scheduling with deferred read-back: step N+1 is packed, staged, filled with
    step N's samples on the device and replayed (a decode graph) while step N still runs,
    and its ids come back later. A sleep kernel queued behind step N keeps the device busy:
    any wait hidden in that path (a staging slot reused before its copy ran, a host read in
    the sampler, a read-back buffer) makes the host wait for the sleep, and the launch
    returns late with its ids already there."""
    import time

    from engine.core.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledSeq, SchedulerOutput
    from engine.worker.model_runner import ModelRunner

    cfg = EngineConfig(
        model=ModelConfig(model="tiny", dtype="bfloat16"),
        cache=CacheConfig(num_blocks=64),
        parallel=ParallelConfig(device="cuda"),
        scheduler=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=256, async_scheduling=True
        ),
    )
    runner = ModelRunner(cfg, 0, 1, "cuda")
    runner.init_kv_cache(64)
    assert runner.graphs is not None and runner.defer_readback
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, repetition_penalty=1.2),
    ]
    prompts = [list(range(1, 20)), list(range(30, 42))]
    tables = [[1, 2], [3, 4]]

    def step(i: int, starts: list[int]):
        first = i == 0
        seqs = [
            ScheduledSeq(
                f"r{j}",
                prompts[j] if first else [PLACEHOLDER_TOKEN_ID],
                starts[j],
                tables[j] if first else [],
                params[j] if first else None,
                penalty_token_ids=prompts[j] if first and j == 1 else None,
                num_prompt_tokens=len(prompts[j]),
                num_blocks=len(tables[j]),
                new_table=first,
                samples=True,
            )
            for j in range(2)
        ]
        sched = SchedulerOutput(i, seqs)
        runner.update_states(sched)
        return runner.execute(sched)

    starts = [len(p) for p in prompts]
    step(0, [0, 0]).resolve_sampled()  # the prefill; then one decode to warm every buffer
    step(1, starts).resolve_sampled()
    out2 = step(2, [s + 1 for s in starts])  # step N, in flight
    torch.cuda._sleep(int(2e9))  # ~1 s more of step N on the device
    t0 = time.perf_counter()
    out3 = step(3, [s + 2 for s in starts])  # step N+1: its placeholders are N's samples
    launch_s = time.perf_counter() - t0
    assert out3.pending_sampled is not None
    in_flight = not out3.pending_sampled[1].ready()
    assert in_flight and launch_s < 0.5, f"step N+1's launch waited for step N ({launch_s:.2f} s)"
    for out in (out2, out3):
        ids = out.resolve_sampled().sampled_token_ids
        assert set(ids) == {"r0", "r1"}
        assert all(0 <= t < runner.arch.vocab_size for t in ids.values())
