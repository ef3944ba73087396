"""P/D on GPUs: prefill and decode nodes on different GPUs, and the TP paths on one GPU.

* ``multi_gpu(n)``: a prefill node and a decode node (processes, ``--device cuda``), each
  on its own GPUs (``CUDA_VISIBLE_DEVICES`` per node, as ``scripts/launch_*.sh`` set it
  from ``GPUS``), behind the proxy, answer what a colocated node answers: TP 1 -> 1,
  2 -> 2 and heterogeneous 1 -> 2, 2 -> 1. The KV goes VRAM -> VRAM from GPU to GPU; the
  prefill node's UCX protocol tables (``UCX_PROTO_INFO=y``) must show its writes on
  ``cuda_ipc`` (``PDSERVE_TEST_EXPECT_TRANSPORT``: another UCX transport name, ``rdma``,
  or ``any`` where the GPUs have no peer access).
* ``gpu``: the same TP layouts (2 -> 2, 1 -> 2, 2 -> 1) on one GPU, the ranks of each
  engine sharing it over gloo (``PDSERVE_TP_SHARE_GPU=1``; NCCL refuses two ranks on one
  GPU), so each rank's KV lives in VRAM, each rank pair's NIXL writes (head slices for
  hetero TP) run, and the executor aggregates every rank's output, for real.
  ``scripts/gpu_check.sh`` runs this file.

``PDSERVE_TEST_HW_ON_CPU=1`` runs them on CPU (conftest skips none; the nodes and engines
get ``--device cpu``): a dry run of the tests themselves where there is no GPU.
"""

from __future__ import annotations

import os

import httpx
import pytest
from harness import GREEDY, NIXL, Procs, sse_events, stream_ids, wait_healthy
from hf_models import random_prompt
from pd_utils import disagg_generate, nixl_config
from test_two_hosts import check_put_transport, ucx_put_protocols

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.worker_proc import SHARE_GPU_ENV, _shared_gpu_config, rank_placement

ON_CPU = os.environ.get("PDSERVE_TEST_HW_ON_CPU") == "1"
DEVICE = "cpu" if ON_CPU else "cuda"
MEM_TYPE = "DRAM" if ON_CPU else "VRAM"
EXPECT = os.environ.get("PDSERVE_TEST_EXPECT_TRANSPORT", "any" if ON_CPU else "cuda_ipc")
BS = 16  # --block-size (default)
MAX_TOKENS = 12
LENGTHS = (1, 17, 40, 300)


def _blocks(prompts: list[list[int]]) -> int:
    return sum(-(-len(x) // BS) for x in prompts)


# -- where each rank runs (no hardware needed) ----------------------------------------------------


def test_rank_placement_one_rank_per_gpu_or_shared_over_gloo():
    assert rank_placement(1, 2, "cpu", 0) == ("cpu", "gloo")
    assert [rank_placement(r, 2, "cuda", 2) for r in range(2)] == [
        ("cuda:0", "nccl"),
        ("cuda:1", "nccl"),
    ]
    assert rank_placement(0, 1, "cuda", 8) == ("cuda:0", "nccl")
    with pytest.raises(RuntimeError, match=f"--tp 2 needs 2 CUDA GPUs.*sees 1.*{SHARE_GPU_ENV}=1"):
        rank_placement(0, 2, "cuda", 1)
    assert [rank_placement(r, 4, "cuda", 2, share=True) for r in range(4)] == [
        ("cuda:0", "gloo"),
        ("cuda:1", "gloo"),
        ("cuda:0", "gloo"),
        ("cuda:1", "gloo"),
    ]
    with pytest.raises(RuntimeError, match="sees 0") as e:
        rank_placement(0, 1, "cuda", 0, share=True)
    assert SHARE_GPU_ENV not in str(e.value)  # sharing nothing does not help


def test_ranks_sharing_a_gpu_run_eager_with_their_share_of_its_memory():
    cfg = EngineConfig(cache=CacheConfig(gpu_memory_utilization=0.8))
    shared = _shared_gpu_config(cfg, world_size=4, num_gpus=1)
    assert shared.model.enforce_eager and not cfg.model.enforce_eager
    assert shared.cache.gpu_memory_utilization == pytest.approx(0.2)
    assert _shared_gpu_config(cfg, 3, 2).cache.gpu_memory_utilization == pytest.approx(0.4)


# -- P and D on different GPUs, through the proxy -----------------------------------------------


def _gpus(first: int, n: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a node on GPUs ``first..first+n-1`` of those this test
    sees (its own ``CUDA_VISIBLE_DEVICES``, e.g. a scheduler's allocation, or all)."""
    mine = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return ",".join(mine[i] if mine else str(i) for i in range(first, first + n))


def _post(url: str, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, **GREEDY}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    ("tp_p", "tp_d"),
    [
        pytest.param(1, 1, marks=pytest.mark.multi_gpu(2), id="P1-D1"),
        pytest.param(2, 2, marks=pytest.mark.multi_gpu(4), id="P2-D2"),
        pytest.param(1, 2, marks=pytest.mark.multi_gpu(3), id="P1-D2"),
        pytest.param(2, 1, marks=pytest.mark.multi_gpu(3), id="P2-D1"),
    ],
)
def test_prefill_and_decode_on_different_gpus_match_colocated(procs: Procs, tp_p, tp_d):
    """P on GPUs 0..tp_p-1, D on the next tp_d GPUs (NCCL within each node), a colocated
    TP 1 node on GPU 0 beside P; float32, so answers compare exactly."""
    node = ("--device", DEVICE, "--dtype", "float32", "--num-blocks", "256")
    pd = (*NIXL, *node, "--kv-checksum", "full")
    env = {"UCX_PROTO_INFO": "y"}
    p = procs.node(*pd, "--tp", str(tp_p), module="prefill_node", name="p", wait=False,
                   env={**env, "CUDA_VISIBLE_DEVICES": _gpus(0, tp_p)})  # fmt: skip
    d = procs.node(*pd, "--tp", str(tp_d), module="decode_node", name="d", wait=False,
                   env={**env, "CUDA_VISIBLE_DEVICES": _gpus(tp_p, tp_d)})  # fmt: skip
    colo = procs.node(
        *node, name="colocated", wait=False, env={"CUDA_VISIBLE_DEVICES": _gpus(0, 1)}
    )
    wait_healthy(p, d, colo)
    proxy = procs.proxy([p.url], [d.url])
    for n, tp in ((p, tp_p), (d, tp_d)):
        info = httpx.get(n.url + "/v1/kv_transfer_info", timeout=10).json()
        assert info["transport"]["mem_type"] == MEM_TYPE, info
        assert info["compat"]["tp_size"] == tp, info

    prompts = [random_prompt(n, 256, seed=n) for n in LENGTHS]
    d_prompt, p_blocks = (
        d.metric("pdserve_prompt_tokens_total"),
        p.metric("pdserve_engine_kv_blocks_sent_total"),
    )
    out = [_post(proxy.url, x) for x in prompts]
    ref = [_post(colo.url, x) for x in prompts]
    assert out == ref
    assert all(len(t) == MAX_TOKENS for t in ref)
    # D decoded from the KV P pushed (no prompt token computed); each D rank got its heads
    # of every block once, checksummed on D's GPU.
    assert d.metric("pdserve_prompt_tokens_total") == d_prompt
    sent = p.metric("pdserve_engine_kv_blocks_sent_total") - p_blocks
    assert sent == _blocks(prompts) * max(tp_p, tp_d)
    assert d.metric("pdserve_engine_kv_checksum_failures_total") == 0
    assert p.metric("pdserve_engine_kv_transfer_failures_total") == 0
    # Streamed through the proxy: the same tokens (D now holds the prompt's blocks).
    with httpx.stream(
        "POST",
        proxy.url + "/v1/completions",
        json={"prompt": prompts[2], "max_tokens": MAX_TOKENS, "stream": True, **GREEDY},
        timeout=300,
    ) as resp:
        assert resp.status_code == 200
        assert stream_ids(sse_events(resp)) == ref[2]
    # Which transport carried P's writes of GPU memory into D's (another GPU, this host).
    tables = ucx_put_protocols(p.stdout_path.read_text(errors="replace"))
    memory = "host" if ON_CPU else "cuda"
    used = check_put_transport(tables, "intra-node", memory, EXPECT, [])
    print("UCX writes of the prefill node:\n  " + "\n  ".join(map(str, used)))


# -- TP ranks sharing one GPU, in-process engines -----------------------------------------------

PAIRS = [(2, 2), (1, 2), (2, 1)]
GREEDY_PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def _pair_prompts(tp_p: int, tp_d: int) -> list[list[int]]:
    # Each pair its own prompts: a D that holds a prompt's blocks would take fewer from P.
    return [random_prompt(n, 256, seed=100 * tp_p + 10 * tp_d + n) for n in LENGTHS]


@pytest.fixture(scope="module")
def one_gpu_engines():
    """Prefill engines with TP 1 and 2, decode engines with TP 1 and 2 (kv checksums on),
    every rank on GPU 0 (shared over gloo), and the colocated TP 1 answers to compare with."""
    pytest.importorskip("nixl._api")
    engines: dict[tuple[str, int], EngineCore] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SHARE_GPU_ENV, "1")
        if not ON_CPU:  # one GPU, also on a host with more (the workers see only it)
            mp.setenv("CUDA_VISIBLE_DEVICES", _gpus(0, 1))
        base = EngineConfig(
            model=ModelConfig(model="tiny", dtype="float32"),
            cache=CacheConfig(num_blocks=128),
            parallel=ParallelConfig(device=DEVICE),
        )
        with LLM(base) as llm:
            colocated = {
                pair: llm.generate_token_ids(_pair_prompts(*pair), GREEDY_PARAMS) for pair in PAIRS
            }
        try:
            for role, tp in (("producer", 1), ("producer", 2), ("consumer", 1), ("consumer", 2)):
                cfg = base.replace(parallel=ParallelConfig(device=DEVICE, tp=tp))
                engines[role, tp] = EngineCore(nixl_config(cfg, role, kv_checksum="full"))
            yield engines, colocated
        finally:
            for eng in engines.values():
                eng.shutdown()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize(("tp_p", "tp_d"), PAIRS, ids=[f"P{p}-D{d}" for p, d in PAIRS])
def test_tp_ranks_sharing_one_gpu_match_colocated(one_gpu_engines, tp_p, tp_d):
    engines, colocated = one_gpu_engines
    p, d = engines["producer", tp_p], engines["consumer", tp_d]
    for eng in (p, d):
        assert eng.connector.info()["transport"]["mem_type"] == MEM_TYPE
    prompts = _pair_prompts(tp_p, tp_d)
    p0, d0 = p.stats(), d.stats()
    res = disagg_generate(p, d, prompts, GREEDY_PARAMS, tag=f"p{tp_p}d{tp_d}-", timeout=300)
    assert res["tokens"] == colocated[tp_p, tp_d]
    assert all(f.error is None and f.finish_reason == "length" for f in res["final"])
    ps, ds = p.stats(), d.stats()
    assert ds["prompt_tokens_total"] == d0["prompt_tokens_total"]  # decoded from P's KV
    assert ds["kv_checksum_failures_total"] == 0  # every D rank's head slices verified
    sent = ps["kv_blocks_sent_total"] - p0["kv_blocks_sent_total"]
    assert sent == _blocks(prompts) * max(tp_p, tp_d)
    for eng in (p, d):
        s = eng.stats()
        assert s["kv_blocks_free"] == s["kv_blocks_total"]
        assert eng.executor.aggregator.pending_ids == set()
