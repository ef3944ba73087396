"""KV integrity (``--kv-checksum``): P checksums what it pushes, D verifies before it
decodes; a block corrupted in flight is a failed transfer (recompute or error), never the
corrupted answer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvconnector.nixl import checksum
from kvconnector.nixl.messages import COMPAT_KEYS, MessageError, Notif, check_compat

sys.path.insert(0, str(Path(__file__).parent))
from hf_models import random_prompt  # noqa: E402
from pd_utils import disagg_generate, nixl_config  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def test_a_change_of_any_one_word_changes_the_block_sum():
    kv = torch.randn(6, 2, 2, 2, 4, 8)  # [blocks, layers, kv, heads, tokens, dim]
    before = checksum.block_sums(kv, list(range(6)))
    words = kv[3].reshape(-1).view(torch.int32)
    for i in (0, 7, words.numel() - 1):
        saved = int(words[i])
        words[i] = saved ^ (1 << (i % 31))
        assert checksum.block_sums(kv, [3]) != [before[3]], f"word {i}"
        words[i] = saved
    assert checksum.block_sums(kv, list(range(6))) == before
    swapped = kv.clone()
    swapped[2, 0, 0, 0, 0, :2] = kv[2, 0, 0, 0, 0, :2].flip(0)  # two values trade places
    if not torch.equal(swapped, kv):
        assert checksum.block_sums(swapped, [2]) != [before[2]]


def test_sums_do_not_depend_on_how_blocks_are_batched():
    kv = torch.randn(80, 1, 2, 1, 4, 4, dtype=torch.bfloat16)
    ids = list(range(79, -1, -3))
    assert checksum.block_sums(kv, ids) == [checksum.block_sums(kv, [b])[0] for b in ids]


def test_which_blocks_each_mode_checks():
    assert checksum.pick(10, "off", "n") == []
    assert checksum.pick(10, "full", "n") == list(range(10))
    sampled = checksum.pick(100, "sampled", "n")
    assert len(sampled) == checksum.SAMPLED_BLOCKS and {0, 99} <= set(sampled)
    assert sampled == checksum.pick(100, "sampled", "n")  # P and a re-check agree
    assert checksum.pick(3, "sampled", "n") == [0, 1, 2]


def test_notif_checksums_are_validated():
    notif = Notif(r="r", t="t", k="k", c=((4, 2**64 - 1), (5, 0)))
    assert Notif.unpack(notif.pack()) == notif
    with pytest.raises(MessageError, match=r"notif.c\[0\]"):
        Notif.from_wire({"r": "r", "t": "t", "k": "k", "c": [[4, -1]]})


def test_peers_with_different_checksum_modes_do_not_pair():
    assert "kv_checksum" in COMPAT_KEYS
    msg = check_compat({"kv_checksum": "full"}, {"kv_checksum": "off"})
    assert msg is not None and "kv_checksum" in msg


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "corrupt", "policy"),
    [("full", False, "recompute"), ("full", True, "recompute"), ("sampled", True, "fail")],
)
def test_a_block_corrupted_in_flight_is_never_decoded_from(monkeypatch, mode, corrupt, policy):
    """Real P and D engines over NIXL. With the fault hook on, every block checked on D is
    corrupted as it arrives: D must recompute (the colocated answer) or fail the request
    -- never answer from the corrupted KV. Without it, D decodes from the pushed KV."""
    if corrupt:
        monkeypatch.setenv("PDSERVE_FAULT_CORRUPT_KV", "1")  # inherited by the workers
    base = EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=128))
    p = EngineCore(nixl_config(base, "producer", kv_checksum=mode))
    d = EngineCore(nixl_config(base, "consumer", kv_checksum=mode, kv_failure_policy=policy))
    try:
        prompts = [random_prompt(n, 256, seed=n) for n in (20, 70)]
        res = disagg_generate(p, d, prompts, GREEDY, timeout=120)
        finals = res["final"]
        d_stats = d.stats()
        if not corrupt:
            with LLM(base) as llm:
                assert res["tokens"] == llm.generate_token_ids(prompts, GREEDY)
            assert d_stats["kv_checksum_failures_total"] == 0
            assert d_stats["prompt_tokens_total"] == 0  # decoded from the pushed KV
        elif policy == "recompute":
            with LLM(base) as llm:
                assert res["tokens"] == llm.generate_token_ids(prompts, GREEDY)
            assert d_stats["kv_checksum_failures_total"] == len(prompts)
            assert d_stats["prompt_tokens_total"] == sum(len(x) for x in prompts)  # recomputed
        else:
            assert [f.finish_reason for f in finals] == ["error"] * len(prompts)
            assert all("checksum" in (f.error or "") for f in finals)
        for eng in (p, d):
            s = eng.stats()
            assert s["kv_blocks_free"] == s["kv_blocks_total"], s
    finally:
        p.shutdown()
        d.shutdown()
