"""Log probabilities, echo, min_tokens, logit_bias and min_p: from the sampler to the
OpenAI shapes, and through a P/D pair.

In-process tests drive the real scheduler and the real model runner (rank 0 of TP 1, no
worker process) on a random Qwen2 checkpoint, and compare every log probability with
``log_softmax`` of the transformers reference model's logits. The live tests (slow) check
the HTTP shapes on a node and that a P/D pair behind the proxy answers the same log
probabilities as a colocated node -- the first token's from the prefill node.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
import torch
from harness import GREEDY, MODEL, PD, Proc, Procs, sse_events
from hf_models import hf_logits, make_hf_model, random_prompt, save_hf_model

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.server.chat_protocol import parse_chat_request
from engine.server.logprobs import (
    TokenIdStrings,
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
    drop_first,
    fill_missing,
    has_missing,
    prompt_logprobs_entries,
    trim,
)
from engine.server.protocol import parse_completion_request
from engine.server.request_fields import APIError
from engine.tokenizer import ByteTokenizer
from engine.worker.model_runner import ModelRunner
from engine.worker.sampler import Sampler, compute_logprobs
from kvconnector.noop import NoopConnectorScheduler

VOCAB = 256
TOL = 2e-4


# -- the sampler ----------------------------------------------------------------------------------


def test_compute_logprobs_is_log_softmax_of_the_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4
    ref = torch.log_softmax(logits, dim=-1)
    out = compute_logprobs(logits, [7, 0, 49], [3, 0, 5])
    for row, (e, tid, k) in enumerate(zip(out, [7, 0, 49], [3, 0, 5], strict=True)):
        assert e.token_id == tid and math.isclose(e.logprob, float(ref[row, tid]), abs_tol=1e-6)
        values, ids = ref[row].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert list(e.top_ids) == ids.tolist()
        assert all(
            math.isclose(a, b, abs_tol=1e-6) for a, b in zip(e.top_logprobs, values, strict=True)
        )
        assert list(e.top_logprobs) == sorted(e.top_logprobs, reverse=True)
        assert e.rank == int((ref[row] > ref[row, tid]).sum()) + 1  # vLLM's rank, 1: best


def test_prompt_logprobs_entries_are_vllms_shape() -> None:
    entries = [None, E(98, -0.5, (120, 98, 99), (-0.1, -0.5, -3.0), rank=2)]
    out = prompt_logprobs_entries([97, 98], entries, STRINGS, 1)
    assert out == [
        None,
        {"98": {"logprob": -0.5, "rank": 2, "decoded_token": "b"},
         "120": {"logprob": -0.1, "rank": 1, "decoded_token": "x"}},
    ]  # fmt: skip
    assert list(out[1]) == ["98", "120"]  # the prompt's token first
    trimmed = trim(entries, 1)[1]
    assert trimmed is not None and trimmed.top_ids == (120,) and trimmed.rank == 2


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 3)])
def test_banned_ids_are_never_sampled(temperature: float, seed: int | None) -> None:
    logits = torch.zeros(2, 10)
    logits[:, 4] = 50.0  # the only likely token
    logits[:, 6] = 40.0
    sp = SamplingParams(temperature=temperature, seed=seed)
    sampler = Sampler()
    assert sampler.sample(logits, [sp, sp], [5, 5]) == [4, 4]
    assert sampler.sample(logits, [sp, sp], [5, 5], [(4,), ()]) == [6, 4]
    assert float(logits[0, 4]) == 50.0  # masked in a copy


# -- the engine in process: scheduler + model runner on a random Qwen2 -----------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, str]:
    model = make_hf_model("qwen2", seed=5)
    return model, save_hf_model(model, tmp_path_factory.mktemp("qwen2_lp"))


class InProcessEngine:
    """The scheduler and a rank-0 model runner in this process (what a TP-1 node runs,
    without the worker process): outputs per request id, and every step's worker output."""

    def __init__(self, path: str, budget: int = 2048, prefix_caching: bool = True) -> None:
        self.config = EngineConfig(
            model=ModelConfig(model=path, dtype="float32", max_model_len=512),
            cache=CacheConfig(block_size=4, num_blocks=256, enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
        )
        self.runner = ModelRunner(self.config, 0, 1, "cpu")
        self.runner.init_kv_cache(256)
        self.sched = Scheduler(
            self.config,
            256,
            512,
            NoopConnectorScheduler(self.config, None),  # type: ignore[arg-type]
        )
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.worker_outputs: list[Any] = []

    def run(self, *requests: Request) -> dict[str, list[RequestOutput]]:
        for r in requests:
            self.sched.add_request(r)
        for _ in range(1000):
            if not self.sched.requests:
                return self.outputs
            so = self.sched.schedule()
            self.runner.update_states(so)
            wo = self.runner.execute(so) if so.num_scheduled_tokens else None
            self.worker_outputs.append(wo)
            mro = ModelRunnerOutput()
            if wo is not None:
                mro = ModelRunnerOutput(
                    sampled_token_ids=wo.sampled_token_ids,
                    logprobs=wo.logprobs,
                    prompt_logprobs=wo.prompt_logprobs,
                )
            for out in self.sched.update_from_output(so, mro):
                self.outputs.setdefault(out.request_id, []).append(out)
        raise AssertionError("requests did not finish")


def _tokens_and_logprobs(outs: list[RequestOutput]) -> tuple[list[int], list[Any], list[Any]]:
    ids: list[int] = []
    lps: list[Any] = []
    prompt: list[Any] = []
    for o in outs:
        ids += o.new_token_ids
        lps += o.new_logprobs if o.new_logprobs is not None else [None] * len(o.new_token_ids)
        prompt = prompt or (o.prompt_logprobs or [])
    return ids, lps, prompt


def _check_against_reference(e: TokenLogprob, ref_row: torch.Tensor, token: int, k: int) -> None:
    assert e.token_id == token
    assert abs(e.logprob - float(ref_row[token])) <= TOL, (e.logprob, float(ref_row[token]))
    values, ids = ref_row.topk(k)
    assert len(e.top_ids) == k
    assert all(abs(a - float(b)) <= TOL for a, b in zip(e.top_logprobs, values, strict=True))
    # Same set of ids (a near-tie may swap neighbours).
    assert set(e.top_ids) == set(ids.tolist()) or k == 0


@pytest.mark.parametrize("budget", [2048, 16])  # one prefill step; chunked prefill
def test_greedy_logprobs_equal_log_softmax_of_the_reference(qwen: Any, budget: int) -> None:
    """Sampled tokens' and prompt tokens' log probabilities (and the top 5) are log_softmax
    of the transformers model's logits at each position; greedy picks the top one."""
    hf, path = qwen
    eng = InProcessEngine(path, budget=budget)
    prompt = random_prompt(37, VOCAB, seed=11)
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, prompt_logprobs=5)
    outs = eng.run(Request("r", prompt, sp))["r"]
    ids, lps, prompt_lps = _tokens_and_logprobs(outs)
    assert len(ids) == 6 and len(lps) == 6 and len(prompt_lps) == len(prompt)
    ref = torch.log_softmax(hf_logits(hf, prompt + ids[:-1]), dim=-1)  # [P + 5, V]
    for i, (tid, e) in enumerate(zip(ids, lps, strict=True)):
        row = ref[len(prompt) - 1 + i]
        _check_against_reference(e, row, tid, 5)
        assert abs(e.logprob - e.top_logprobs[0]) <= TOL  # greedy: the most likely
    assert prompt_lps[0] is None  # nothing predicts the first prompt token
    for p in range(1, len(prompt)):
        _check_against_reference(prompt_lps[p], ref[p - 1], prompt[p], 5)


def test_prompt_logprobs_skip_the_prefix_cache_and_plain_requests_pay_nothing(qwen: Any) -> None:
    hf, path = qwen
    eng = InProcessEngine(path)
    prompt = random_prompt(24, VOCAB, seed=12)
    plain = eng.run(Request("a", prompt, SamplingParams(max_tokens=2, temperature=0.0)))["a"]
    assert all(o.new_logprobs is None and o.prompt_logprobs is None for o in plain)
    assert all(not w.logprobs and not w.prompt_logprobs for w in eng.worker_outputs if w)
    # The same prompt again: its blocks are cached, but prompt logprobs need them computed.
    sp = SamplingParams(max_tokens=2, temperature=0.0, logprobs=0, prompt_logprobs=0)
    _, lps, prompt_lps = _tokens_and_logprobs(eng.run(Request("b", prompt, sp))["b"])
    ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    assert len(prompt_lps) == len(prompt) and prompt_lps[0] is None
    for p in range(1, len(prompt)):
        assert abs(prompt_lps[p].logprob - float(ref[p - 1, prompt[p]])) <= TOL
        assert prompt_lps[p].top_ids == ()
    assert lps[0].top_ids == ()  # logprobs=0: the sampled token's only


def test_seeded_sampling_logprobs_are_those_of_the_sampled_token(qwen: Any) -> None:
    hf, path = qwen
    eng = InProcessEngine(path)
    prompt = random_prompt(9, VOCAB, seed=13)
    sp = SamplingParams(max_tokens=5, temperature=1.5, seed=4, logprobs=3)
    ids, lps, _ = _tokens_and_logprobs(eng.run(Request("s", prompt, sp))["s"])
    ref = torch.log_softmax(hf_logits(hf, prompt + ids[:-1]), dim=-1)
    for i, (tid, e) in enumerate(zip(ids, lps, strict=True)):
        _check_against_reference(e, ref[len(prompt) - 1 + i], tid, 3)  # raw, not /T


def test_min_tokens_holds_back_eos_and_stop_ids(qwen: Any) -> None:
    """Greedy would stop at once (its first token is a stop id); min_tokens=3 bans it until
    three tokens are out, as vLLM does."""
    _, path = qwen
    eng = InProcessEngine(path)
    prompt = random_prompt(10, VOCAB, seed=14)
    first = eng.run(Request("g", prompt, SamplingParams(max_tokens=1, temperature=0.0)))["g"]
    stop = first[-1].new_token_ids[0]
    base = dict(max_tokens=8, temperature=0.0, stop_token_ids=[stop])
    quick = eng.run(Request("q", prompt, SamplingParams(**base)))["q"]  # type: ignore[arg-type]
    assert _tokens_and_logprobs(quick)[0] == [stop] and quick[-1].finish_reason == "stop"
    held = eng.run(Request("m", prompt, SamplingParams(**base, min_tokens=3)))["m"]  # type: ignore[arg-type]
    ids = _tokens_and_logprobs(held)[0]
    assert len(ids) >= 3 and stop not in ids[:3]
    # EOS the same way (the request's eos ids), unless ignore_eos.
    eos = eng.run(Request("e", prompt, SamplingParams(max_tokens=8, temperature=0.0, min_tokens=2), eos_token_ids=[stop]))["e"]  # fmt: skip
    assert stop not in _tokens_and_logprobs(eos)[0][:2]


def test_allowed_token_ids_confine_every_token_and_logprobs_stay_raw(qwen: Any) -> None:
    """Through the scheduler and the model runner: greedy and sampled requests draw only
    allowed ids in every step, and their log probabilities are the model's (raw: not
    renormalised over the allowed ids); a request without it, run alongside, is unchanged."""
    hf, path = qwen
    eng = InProcessEngine(path)
    prompt = random_prompt(12, VOCAB, seed=15)
    free = eng.run(Request("f", prompt, SamplingParams(max_tokens=6, temperature=0.0)))["f"]
    free_ids = _tokens_and_logprobs(free)[0]
    allowed = [t for t in (7, 19, 88, 140, 201) if t not in free_ids][:4]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, allowed_token_ids=allowed)
    sampled = SamplingParams(
        max_tokens=6, temperature=1.0, seed=9, logprobs=2, allowed_token_ids=allowed
    )
    outs = eng.run(
        Request("g", prompt, greedy),
        Request("s", prompt, sampled),
        Request("p", prompt, SamplingParams(max_tokens=6, temperature=0.0)),
    )
    assert _tokens_and_logprobs(outs["p"])[0] == free_ids
    for rid in ("g", "s"):
        ids, lps, _ = _tokens_and_logprobs(outs[rid])
        assert len(ids) == 6 and set(ids) <= set(allowed), (rid, ids)
        ref = torch.log_softmax(hf_logits(hf, prompt + ids[:-1]), dim=-1)
        for i, (tid, e) in enumerate(zip(ids, lps, strict=True)):
            row = ref[len(prompt) - 1 + i]
            _check_against_reference(e, row, tid, 2)  # the top 2 of all ids, not the allowed
            if rid == "g":  # the most likely allowed id
                assert tid == max(allowed, key=lambda t: float(row[t]))


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 21)])
def test_allowed_token_ids_that_min_tokens_bans_are_drawn_and_the_answer_still_waits(
    qwen: Any, temperature: float, seed: int | None
) -> None:
    """Every allowed id a stop id, min_tokens 3: the ban would leave no id (NaN, or vLLM's
    token 0), so it is lifted for the row: the answer is allowed ids alone, and as it cannot
    stop before min_tokens it stops at the third."""
    hf, path = qwen
    eng = InProcessEngine(path)
    prompt = random_prompt(10, VOCAB, seed=16)
    sp = SamplingParams(max_tokens=8, temperature=temperature, seed=seed, logprobs=0,
                        allowed_token_ids=[42, 77], stop_token_ids=[42, 77], min_tokens=3)  # fmt: skip
    outs = eng.run(Request("b", prompt, sp))["b"]
    ids, lps, _ = _tokens_and_logprobs(outs)
    assert len(ids) == 3 and set(ids) <= {42, 77} and outs[-1].finish_reason == "stop", ids
    ref = torch.log_softmax(hf_logits(hf, prompt + ids[:-1]), dim=-1)
    for i, (tid, e) in enumerate(zip(ids, lps, strict=True)):
        assert math.isfinite(e.logprob)
        assert abs(e.logprob - float(ref[len(prompt) - 1 + i, tid])) <= TOL


def test_a_decode_node_leaves_what_the_prefill_node_computed_empty() -> None:
    """On a P/D decode node the first token arrives with the KV: its entry (and, with
    echo, the prompt's) is None -- the proxy fills them from the prefill node's answer --
    while the tokens the node samples itself carry theirs."""
    from fakes import RemotePrefill  # the fake decode connector
    from test_request_metrics import _config

    from kvconnector.params import KVTransferParams

    conn = RemotePrefill(_config())
    sch = Scheduler(_config(), 64, 256, conn)
    params = KVTransferParams(
        do_remote_prefill=True, transfer_id="t", remote_side_channel="tcp://127.0.0.1:1"
    )
    sp = SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=2)
    sch.add_request(Request("d", list(range(1, 9)), sp, kv_transfer_params=params))
    sch.update_from_output(sch.schedule(), ModelRunnerOutput())
    conn.landed = {"d": {"first_token": 42}}
    (out,) = sch.update_from_output(sch.schedule(), ModelRunnerOutput())
    assert out.new_token_ids == [42] and out.new_logprobs == [None]
    assert out.prompt_logprobs == [None] * 8
    so = sch.schedule()
    assert not so.seqs[0].prompt_targets  # the prompt is not computed here
    lp = TokenLogprob(43, -0.5, (43, 7), (-0.5, -1.0))
    (out,) = sch.update_from_output(
        so, ModelRunnerOutput(sampled_token_ids={"d": 43}, logprobs={"d": lp})
    )
    assert out.new_logprobs == [lp] and out.prompt_logprobs is None


# -- the OpenAI shapes -----------------------------------------------------------------------------

STRINGS = TokenStrings(ByteTokenizer())
E = TokenLogprob


def test_completion_shape() -> None:
    ids = [ord("a"), ord("b")]
    entries = [E(97, -0.1, (97, 120), (-0.1, -3.0)), E(98, -2.0, (120,), (-0.5,))]
    body, end = completion_logprobs(ids, entries, STRINGS, text_offset=5)
    assert body == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.1, -2.0],
        "top_logprobs": [{"a": -0.1, "x": -3.0}, {"x": -0.5, "b": -2.0}],  # + the chosen
        "text_offset": [5, 6],
    }
    assert end == 7
    placeholder, _ = completion_logprobs([97], [None], STRINGS)
    assert placeholder["token_logprobs"] == [None] and placeholder["top_logprobs"] == [None]
    clamped, _ = completion_logprobs([97], [E(97, -math.inf)], STRINGS)
    assert clamped["token_logprobs"] == [-9999.0] and clamped["top_logprobs"] == [{"a": -9999.0}]


def test_tokens_as_token_ids_name_every_token_by_id_and_offsets_stay_the_texts() -> None:
    """vLLM's ``return_tokens_as_token_ids``: ``token_id:<id>`` names, bytes of the name."""
    by_id = TokenIdStrings(ByteTokenizer())
    entries = [E(97, -0.1, (97, 120), (-0.1, -3.0)), E(0xE2, -2.0, (120,), (-0.5,))]
    body, end = completion_logprobs([97, 0xE2], entries, by_id, text_offset=5)
    assert body["tokens"] == ["token_id:97", "token_id:226"]
    assert body["top_logprobs"] == [
        {"token_id:97": -0.1, "token_id:120": -3.0},
        {"token_id:120": -0.5, "token_id:226": -2.0},
    ]
    assert body["text_offset"] == [5, 6] and end == 5 + len(STRINGS.text(97) + STRINGS.text(0xE2))
    chat = chat_logprobs([98], [E(98, -1.0, (98,), (-1.0,))], by_id)["content"][0]
    assert chat["token"] == "token_id:98" and chat["bytes"] == list(b"token_id:98")
    assert chat["top_logprobs"][0]["token"] == "token_id:98"


def test_chat_shape() -> None:
    body = chat_logprobs([0xE2], [E(0xE2, -1.0, (0xE2, 97), (-1.0, -2.0))], STRINGS)
    item = body["content"][0]
    assert item["logprob"] == -1.0 and item["bytes"] == [0xE2]  # a part of a UTF-8 character
    assert [t["bytes"] for t in item["top_logprobs"]] == [[0xE2], [97]]
    assert item["top_logprobs"][1] == {"token": "a", "logprob": -2.0, "bytes": [97]}
    assert chat_logprobs([97], [None], STRINGS)["content"][0]["logprob"] is None


@pytest.mark.parametrize("chat", [False, True])
def test_the_proxy_fills_what_the_decode_node_left_empty(chat: bool) -> None:
    def make(entries: list[Any], ids: list[int]) -> dict[str, Any]:
        if chat:
            return chat_logprobs(ids, entries, STRINGS)
        return completion_logprobs(ids, entries, STRINGS)[0]

    p = make([None, E(98, -1.0, (98,), (-1.0,)), E(99, -2.0, (99,), (-2.0,))], [97, 98, 99])
    d = make([None, None, None, E(100, -3.0, (100,), (-3.0,))], [97, 98, 99, 100])
    assert has_missing(d, chat)
    assert fill_missing(d, p, chat) == 2  # index 0 stays null: no one predicts it
    assert d == make(
        [None, E(98, -1.0, (98,), (-1.0,)), E(99, -2.0, (99,), (-2.0,)), E(100, -3.0, (100,), (-3.0,))],
        [97, 98, 99, 100],
    )  # fmt: skip
    # A stream chunk: its first entry is the answer's third.
    chunk = make([None, E(100, -3.0, (100,), (-3.0,))], [99, 100])
    assert fill_missing(chunk, p, chat, start=2) == 1
    assert chunk == make([E(99, -2.0, (99,), (-2.0,)), E(100, -3.0, (100,), (-3.0,))], [99, 100])
    drop_first(chunk, chat, 1)
    expected = make([E(100, -3.0, (100,), (-3.0,))], [100])
    if not chat:
        expected["text_offset"] = [1]  # offsets stay where the tokens are in the text
    assert chunk == expected


# -- request fields --------------------------------------------------------------------------------

_MSG = [{"role": "user", "content": "hi"}]


def test_fields_reach_the_sampling_params() -> None:
    sp = parse_completion_request(
        {"prompt": "x", "logprobs": 3, "echo": True, "min_tokens": 2}
    ).sampling_params(16)
    assert (sp.logprobs, sp.prompt_logprobs, sp.min_tokens) == (3, 3, 2)
    sp = parse_completion_request({"prompt": "x", "logprobs": 0}).sampling_params(16)
    assert (sp.logprobs, sp.prompt_logprobs) == (0, None)
    sp = parse_completion_request({"prompt": "x", "echo": True}).sampling_params(16)
    assert (sp.logprobs, sp.prompt_logprobs) == (None, None)
    chat = parse_chat_request({"messages": _MSG, "logprobs": True, "top_logprobs": 4})
    assert chat.sampling_params(100).logprobs == 4
    assert parse_chat_request({"messages": _MSG, "logprobs": True}).logprobs == 0
    assert parse_chat_request({"messages": _MSG, "logprobs": False}).logprobs is None
    # A chat's max_tokens is resolved later: min_tokens is checked against that budget.
    chat = parse_chat_request({"messages": _MSG, "min_tokens": 50})
    with pytest.raises(APIError) as info:
        chat.sampling_params(10)
    assert info.value.param == "min_tokens"


def test_echo_with_max_tokens_0_is_the_prompt_alone_and_max_tokens_0_needs_echo() -> None:
    """vLLM's echo without generation (lm-evaluation-harness's loglikelihood request):
    ``echo`` with ``max_tokens`` 0 is accepted; ``max_tokens`` 0 alone is a 400 that says
    what to do; chat has no such request."""
    body = {"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    req = parse_completion_request(body)
    assert (req.max_tokens, req.echo_without_generation) == (0, True)
    # The engine computes the prompt's log probabilities (and samples the one token it
    # must, which the answer leaves out: the node runs it with max_tokens 1).
    sp = req.sampling_params(1)
    assert (sp.max_tokens, sp.prompt_logprobs) == (1, 1)
    batch = parse_completion_request({**body, "prompt": ["a", [1, 2]]})
    assert all(c.echo_without_generation for c in batch.children())
    assert not parse_completion_request({"prompt": "x", "echo": True}).echo_without_generation
    for bad, param in [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0, "echo": False}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
        # The engine runs it with max_tokens 1 (vLLM's): min_tokens past 1 is vLLM's 400.
        ({"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 2}, "min_tokens"),
        # Nothing is decoded: it is not a P/D leg (the proxy serves it on one node).
        ({**body, "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ({**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "t",
                                         "remote_side_channel": "tcp://127.0.0.1:1"}}, "kv_transfer_params"),
    ]:  # fmt: skip
        with pytest.raises(APIError) as info:
            parse_completion_request(bad)
        assert info.value.param == param, bad
        if bad.get("max_tokens") == 0 and param == "max_tokens":
            assert "'echo': true" in info.value.message, info.value.message
    # vLLM accepts min_tokens 1 (its SamplingParams get max_tokens 1): it only bans EOS
    # and the stop ids from the token the answer leaves out.
    sp = parse_completion_request({**body, "min_tokens": 1}).sampling_params(1)
    assert (sp.max_tokens, sp.min_tokens) == (1, 1)
    with pytest.raises(APIError) as info:
        parse_completion_request({**body, "min_tokens": 2})
    assert "at most 1" in info.value.message, info.value.message
    # A transfer id alone (the proxy's decode-only request) is a plain request.
    alone = parse_completion_request({**body, "kv_transfer_params": {"transfer_id": "t"}})
    assert alone.echo_without_generation
    with pytest.raises(APIError) as info:
        parse_chat_request({"messages": _MSG, "max_tokens": 0, "echo": True})
    assert info.value.param == "max_tokens"


def test_unknown_fields_are_named_and_vllm_fields_that_matter_are_refused() -> None:
    req = parse_chat_request({"messages": _MSG, "foo": 1, "bar": None, "top_logprobs": 0})
    assert req.ignored_fields == ("foo", "bar")
    assert parse_completion_request({"prompt": "x", "min_p": 0.0}).ignored_fields == ()
    for path, body, param in [
        ("c", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ("c", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("c", {"prompt": "x", "guided_json": 5}, "guided_json"),
        ("c", {"prompt": "x", "response_format": {"type": "yaml"}}, "response_format.type"),
        ("chat", {"messages": _MSG, "documents": [{"text": "x"}]}, "documents"),
        ("chat", {"messages": _MSG, "chat_template": 5}, "chat_template"),
        (
            "chat",
            {"messages": _MSG, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),  # fmt: skip
        ("c", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ("c", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ]:
        parse = parse_chat_request if path == "chat" else parse_completion_request
        with pytest.raises(APIError) as info:
            parse(body)
        assert info.value.param == param, body
        assert param in info.value.message


# -- live: a node's HTTP answers -----------------------------------------------------------------


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    body = {"model": MODEL, **body, "stream": True}
    with httpx.stream("POST", url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        return [e for e in sse_events(resp) if isinstance(e, dict) and e.get("choices")]


def _joined_completion(events: list[dict[str, Any]]) -> tuple[str, dict[str, list[Any]]]:
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        c = e["choices"][0]
        text += c["text"]
        for key in lp:
            lp[key] += (c["logprobs"] or {}).get(key, [])
    return text, lp


def _joined_chat(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [x for e in events for x in ((e["choices"][0]["logprobs"] or {}).get("content") or [])]


def _close(a: Any, b: Any) -> None:
    """Equal structures, numbers within TOL."""
    if isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None and abs(a - b) <= 1e-4, (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (a, b)
        for k in a:
            _close(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b, strict=True):
            _close(x, y)
    else:
        assert a == b, (a, b)


COMPLETION = {"prompt": "logprobs please", "max_tokens": 5, **GREEDY, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **GREEDY}
CHAT_IGNORE = {**CHAT, "ignore_eos": True}


@pytest.fixture(scope="module")
def node(module_procs: Procs) -> Proc:
    return module_procs.node("--model", MODEL, "--num-blocks", "256")


@pytest.mark.slow
def test_node_completion_logprobs_stream_equals_non_stream(node: Proc) -> None:
    body = {**COMPLETION, "logprobs": 3}
    full = _post(node.url, "/v1/completions", body)["choices"][0]
    lp = full["logprobs"]
    assert len(lp["tokens"]) == len(full["token_ids"]) == 5
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"])
    assert all(1 <= len(t) <= 4 for t in lp["top_logprobs"])  # tiny: ids past 257 share ""
    assert lp["text_offset"][0] == 0
    text, streamed = _joined_completion(_stream(node.url, "/v1/completions", body))
    assert text == full["text"]
    _close(streamed, lp)
    # Without logprobs: null, as before.
    assert _post(node.url, "/v1/completions", COMPLETION)["choices"][0]["logprobs"] is None


@pytest.mark.slow
def test_node_echo_with_and_without_logprobs(node: Proc) -> None:
    plain = _post(node.url, "/v1/completions", COMPLETION)["choices"][0]
    echo = _post(node.url, "/v1/completions", {**COMPLETION, "echo": True})["choices"][0]
    assert echo["text"] == COMPLETION["prompt"] + plain["text"]
    assert echo["token_ids"] == plain["token_ids"] and echo["logprobs"] is None
    both = _post(node.url, "/v1/completions", {**COMPLETION, "echo": True, "logprobs": 1})
    lp = both["choices"][0]["logprobs"]
    n_prompt = both["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + 5
    assert "".join(lp["tokens"][:n_prompt]) == COMPLETION["prompt"]  # tiny: a byte a token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    text, streamed = _joined_completion(
        _stream(node.url, "/v1/completions", {**COMPLETION, "echo": True, "logprobs": 1})
    )
    assert text == both["choices"][0]["text"]
    _close(streamed, lp)


# lm-evaluation-harness's loglikelihood request (``local-completions``), a batch of a text
# prompt and a token-id prompt ("hi there", a byte a token on tiny).
ECHO_ONLY = {"prompt": ["logprobs please", [104, 105, 32, 116, 104, 101, 114, 101]],
             "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}  # fmt: skip
ECHO_ONLY_TEXTS = ["logprobs please", "hi there"]  # the prompts' texts


def _echo_only_expected(url: str) -> list[dict[str, Any]]:
    """Each prompt's choice as ``max_tokens: 1`` with echo answers it, less its one
    generated token: the prompt's text and the prompt's log probabilities."""
    out = []
    for prompt, text in zip(ECHO_ONLY["prompt"], ECHO_ONLY_TEXTS, strict=True):
        one = _post(url, "/v1/completions", {**ECHO_ONLY, "prompt": prompt, "max_tokens": 1})
        choice = one["choices"][0]
        n = one["usage"]["prompt_tokens"]
        assert len(choice["token_ids"]) == 1 and len(choice["logprobs"]["tokens"]) == n + 1
        assert choice["text"].startswith(text)
        lp = {k: v[:n] for k, v in choice["logprobs"].items()}
        out.append({"text": text, "logprobs": lp, "prompt_tokens": n})
    return out


def _check_echo_only(body: dict[str, Any], expected: list[dict[str, Any]]) -> None:
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for choice, want in zip(choices, expected, strict=True):
        assert choice["text"] == want["text"]
        _close(choice["logprobs"], want["logprobs"])
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
        assert choice["token_ids"] == []  # nothing generated
    n = sum(w["prompt_tokens"] for w in expected)
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}


def _echo_only_streamed(url: str) -> dict[str, Any]:
    """The stream of ``ECHO_ONLY`` (with usage) as one body: each choice's chunks joined;
    each choice comes in one chunk (the echoed prompt and its finish)."""
    body = {"model": MODEL, **ECHO_ONLY, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        events = sse_events(resp)
    assert events[-1] == "DONE" and not any("error" in e for e in events[:-1])
    by_index: dict[int, list[dict[str, Any]]] = {}
    for e in events[:-2]:
        for c in e["choices"]:
            by_index.setdefault(c["index"], []).append(c)
    assert sorted(by_index) == [0, 1] and all(len(cs) == 1 for cs in by_index.values())
    return {"choices": [cs[0] for cs in by_index.values()], "usage": events[-2]["usage"]}


@pytest.mark.slow
def test_node_echo_with_max_tokens_0_answers_the_prompt_alone(node: Proc) -> None:
    """vLLM's echo without generation: the prompt's text and log probabilities (what
    ``max_tokens: 1`` with echo answers for the prompt part), nothing generated,
    ``finish_reason`` "length", no completion tokens; streamed the same."""
    expected = _echo_only_expected(node.url)
    _check_echo_only(_post(node.url, "/v1/completions", ECHO_ONLY), expected)
    _check_echo_only(_echo_only_streamed(node.url), expected)
    one = _post(node.url, "/v1/completions", {**ECHO_ONLY, "prompt": "logprobs please"})
    assert one["choices"][0]["text"] == expected[0]["text"]
    plain = _post(node.url, "/v1/completions", {**ECHO_ONLY, "logprobs": None})
    assert [c["text"] for c in plain["choices"]] == [w["text"] for w in expected]
    assert all(c["logprobs"] is None for c in plain["choices"])
    # min_tokens 1 (vLLM's max_tokens 1 takes it): the same answer; 2 is a 400 naming it.
    _check_echo_only(_post(node.url, "/v1/completions", {**ECHO_ONLY, "min_tokens": 1}), expected)
    resp = httpx.post(
        node.url + "/v1/completions",
        json={"model": MODEL, **ECHO_ONLY, "min_tokens": 2},
        timeout=60,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "min_tokens", resp.text
    # Without echo, max_tokens 0 is a 400 naming max_tokens (and saying what to do).
    resp = httpx.post(
        node.url + "/v1/completions",
        json={"model": MODEL, **ECHO_ONLY, "echo": False},
        timeout=60,
    )
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "max_tokens" and "echo" in err["message"], err


@pytest.mark.slow
def test_node_names_tokens_by_id_when_asked(node: Proc) -> None:
    body = {**COMPLETION, "logprobs": 1, "return_tokens_as_token_ids": True}
    full = _post(node.url, "/v1/completions", body)["choices"][0]
    assert full["logprobs"]["tokens"] == [f"token_id:{t}" for t in full["token_ids"]]
    assert all(k.startswith("token_id:") for top in full["logprobs"]["top_logprobs"] for k in top)
    chat = {**CHAT_IGNORE, "logprobs": True, "return_tokens_as_token_ids": True}
    got = _post(node.url, "/v1/chat/completions", chat)["choices"][0]
    assert [c["token"] for c in got["logprobs"]["content"]] == [
        f"token_id:{t}" for t in got["token_ids"]
    ]


@pytest.mark.slow
def test_node_chat_logprobs(node: Proc) -> None:
    body = {**CHAT_IGNORE, "logprobs": True, "top_logprobs": 2}
    full = _post(node.url, "/v1/chat/completions", body)["choices"][0]
    content = full["logprobs"]["content"]
    assert len(content) == len(full["token_ids"])
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(item["top_logprobs"]) == 2 and item["logprob"] <= 0
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
    _close(_joined_chat(_stream(node.url, "/v1/chat/completions", body)), content)
    only = _post(node.url, "/v1/chat/completions", {**CHAT_IGNORE, "logprobs": True})
    assert all(i["top_logprobs"] == [] for i in only["choices"][0]["logprobs"]["content"])


@pytest.mark.slow
def test_node_min_tokens_and_unknown_fields(node: Proc) -> None:
    first = _post(node.url, "/v1/completions", {**COMPLETION, "max_tokens": 1})
    stop_id = first["choices"][0]["token_ids"][0]
    body = {**COMPLETION, "max_tokens": 6, "stop_token_ids": [stop_id]}
    assert _post(node.url, "/v1/completions", body)["choices"][0]["token_ids"] == [stop_id]
    held = _post(node.url, "/v1/completions", {**body, "min_tokens": 4})["choices"][0]
    assert len(held["token_ids"]) >= 4 and stop_id not in held["token_ids"][:4]
    resp = _post(node.url, "/v1/completions", {**COMPLETION, "not_a_field_xyz": 1})
    assert (
        resp["choices"][0]["text"]
        == _post(node.url, "/v1/completions", COMPLETION)["choices"][0]["text"]
    )
    assert "ignored: 'not_a_field_xyz'" in node.logs(200_000)


@pytest.mark.slow
def test_node_logit_bias_steers_every_token_and_refuses_ids_past_the_vocabulary(
    node: Proc,
) -> None:
    plain = _post(node.url, "/v1/completions", COMPLETION)["choices"][0]["token_ids"]
    forced = {**COMPLETION, "logit_bias": {"101": 100}}
    assert _post(node.url, "/v1/completions", forced)["choices"][0]["token_ids"] == [101] * 5
    banned = {**COMPLETION, "logit_bias": {str(plain[0]): -100}}
    assert _post(node.url, "/v1/completions", banned)["choices"][0]["token_ids"][0] != plain[0]
    chat = {**CHAT_IGNORE, "logit_bias": {"101": 100}}
    assert _post(node.url, "/v1/chat/completions", chat)["choices"][0]["token_ids"] == [101] * 5
    vocab = 512  # tiny's
    bad = httpx.post(
        node.url + "/v1/completions",
        json={"model": MODEL, **COMPLETION, "logit_bias": {str(vocab): 1}},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias", bad.text


@pytest.mark.slow
def test_node_allowed_token_ids_confine_every_token_and_refuse_ids_past_the_vocabulary(
    node: Proc,
) -> None:
    plain = _post(node.url, "/v1/completions", {**COMPLETION, "logprobs": 0})["choices"][0]
    ids = plain["token_ids"]
    allowed = [101, 116, 32, 104]  # "e", "t", " ", "h"
    body = {**COMPLETION, "allowed_token_ids": allowed, "logprobs": 0}
    for extra in ({}, {"temperature": 1.0, "seed": 3, "max_tokens": 12}):
        got = _post(node.url, "/v1/completions", {**body, **extra})["choices"][0]
        assert got["token_ids"] and set(got["token_ids"]) <= set(allowed), got["token_ids"]
    chat = _post(node.url, "/v1/chat/completions", {**CHAT_IGNORE, "allowed_token_ids": [101]})
    assert chat["choices"][0]["token_ids"] == [101] * 5
    # Log probabilities are the model's: the greedy first token (allowed along with one
    # other id) has the log probability it has without the field, not one renormalised
    # over the two ids.
    pair = {**COMPLETION, "allowed_token_ids": [ids[0], 101 if ids[0] != 101 else 116],
            "logprobs": 0, "max_tokens": 1}  # fmt: skip
    first = _post(node.url, "/v1/completions", pair)["choices"][0]
    assert first["token_ids"] == ids[:1]
    _close(first["logprobs"]["token_logprobs"][0], plain["logprobs"]["token_logprobs"][0])
    assert plain["logprobs"]["token_logprobs"][0] < math.log(0.5)  # (a renormalised one is not)
    # null or empty: every token.
    for off in (None, []):
        again = _post(node.url, "/v1/completions", {**COMPLETION, "allowed_token_ids": off})
        assert again["choices"][0]["token_ids"] == ids
    vocab = 512  # tiny's
    for bad in ([vocab], [1, vocab + 7], [-1]):
        resp = httpx.post(
            node.url + "/v1/completions",
            json={"model": MODEL, **COMPLETION, "allowed_token_ids": bad},
            timeout=60,
        )
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "allowed_token_ids", resp.text


# -- live: P/D behind the proxy answers what a colocated node answers --------------------------------


@pytest.fixture(scope="module")
def pd_nodes(module_procs: Procs) -> PD:
    return module_procs.pd(1, 1, "--num-blocks", "256", colocated=True)


@pytest.fixture(scope="module", params=["proxy-skips", "node-skips"])
def pd(request: Any, module_procs: Procs, pd_nodes: PD) -> tuple[PD, Proc]:
    """The pair behind a proxy that drops the pre-streamed first token from D's stream
    itself (the default), or asks D to (``--node-skip-first-token``)."""
    flags = ("--node-skip-first-token",) if request.param == "node-skips" else ()
    return pd_nodes, module_procs.proxy([pd_nodes.p.url], [pd_nodes.d.url], *flags)


CASES = [
    ("/v1/completions", {**COMPLETION, "logprobs": 2}),
    ("/v1/completions", {**COMPLETION, "logprobs": 2, "stop": ["zzz"]}),  # D streams alone
    ("/v1/completions", {**COMPLETION, "logprobs": 1, "echo": True}),
    ("/v1/chat/completions", {**CHAT_IGNORE, "logprobs": True, "top_logprobs": 3}),
    # Sampled with logit_bias and min_p: P's first token and D's rest are colocated's. (The
    # bias keeps to ASCII: a stream's offsets count the text streamed, which differs from
    # the tokens' names where a byte starts a character; vLLM's rule.)
    ("/v1/completions", {**COMPLETION, "temperature": 1.0, "seed": 11, "min_p": 0.1,
                         "logit_bias": {"101": 6, "116": 6, "32": 6, "262": -100},
                         "max_tokens": 8, "logprobs": 1}),
    # Tokens named by id: P's first token's entry and D's alike.
    ("/v1/completions", {**COMPLETION, "logprobs": 2, "return_tokens_as_token_ids": True}),
    # allowed_token_ids: P and D mask the same ids (sampled, with the min_tokens ban).
    ("/v1/completions", {**COMPLETION, "temperature": 1.0, "seed": 13, "max_tokens": 8,
                         "allowed_token_ids": [101, 116, 32, 104, 115], "logprobs": 2,
                         "min_tokens": 3, "stop_token_ids": [32]}),
    # Penalties: D counts P's first token as output (chat: no text offsets to differ).
    ("/v1/chat/completions", {**CHAT_IGNORE, "max_tokens": 8, "logprobs": True,
                              "presence_penalty": 1.0, "frequency_penalty": 0.5,
                              "repetition_penalty": 1.3}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("path, body", CASES)
def test_pd_logprobs_equal_colocated(pd: tuple[PD, Proc], path: str, body: dict[str, Any]) -> None:
    """Through the proxy, the first token's log probabilities come from the prefill node's
    answer and the rest from the decode node: together, what a colocated node answers --
    in one JSON body and streamed."""
    pair, proxy = pd
    assert pair.colocated is not None
    chat = path.endswith("chat/completions")
    ref = _post(pair.colocated.url, path, body)["choices"][0]["logprobs"]
    got = _post(proxy.url, path, body)["choices"][0]["logprobs"]
    _close(got, ref)
    events = _stream(proxy.url, path, body)
    if chat:
        _close(_joined_chat(events), ref["content"])
    else:
        _close(_joined_completion(events)[1], ref)
    # Nothing is left null but the first prompt token's (echo): the proxy filled P's.
    nulls = (
        [i for i, x in enumerate(got["content"]) if x["logprob"] is None]
        if chat
        else [i for i, v in enumerate(got["token_logprobs"]) if v is None]
    )
    assert nulls == ([0] if body.get("echo") else [])


def _without_id(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.mark.slow
def test_pd_echo_with_max_tokens_0_equals_colocated(pd: tuple[PD, Proc]) -> None:
    """Through the proxy, echo without generation answers what a colocated node does
    (a body and a stream): it generates nothing, so it needs no KV transfer, and the
    decode node serves it alone (it computes the prompt's log probabilities itself)."""
    pair, proxy = pd
    assert pair.colocated is not None
    expected = _echo_only_expected(pair.colocated.url)
    ref = _post(pair.colocated.url, "/v1/completions", ECHO_ONLY)

    def modes() -> tuple[float, float]:
        return tuple(  # type: ignore[return-value]
            proxy.metric("pdproxy_route_mode_total", {"mode": m})
            for m in ("decode_only", "disaggregated")
        )

    before = modes()
    got = _post(proxy.url, "/v1/completions", ECHO_ONLY)
    _check_echo_only(got, expected)
    _close(_without_id(got), _without_id(ref))
    _check_echo_only(_echo_only_streamed(proxy.url), expected)
    _check_echo_only(_post(proxy.url, "/v1/completions", {**ECHO_ONLY, "min_tokens": 1}), expected)
    # Each prompt's choice went to the decode node alone: no prefill leg, no KV.
    assert modes() == (before[0] + 6, before[1])
    # Without echo, still the node's 400 (the proxy's own parser), before any node.
    resp = httpx.post(
        proxy.url + "/v1/completions", json={"model": MODEL, **ECHO_ONLY, "echo": False}
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


def test_json_roundtrip_of_entries() -> None:
    """The worker output pickles and the shapes are JSON (no -inf, no tuples lost)."""
    body, _ = completion_logprobs([97], [E(97, -math.inf, (97,), (-math.inf,))], STRINGS)
    assert json.loads(json.dumps(body, allow_nan=False))["token_logprobs"] == [-9999.0]


def test_an_echoed_prompts_first_entry_is_not_missing() -> None:
    """With echo the first prompt token has no log probability on any node (nothing
    predicts it): it is not an entry the proxy waits for P to fill. It was: with P hung,
    every echo + logprobs request waited 30 s for P's answer."""
    complete = completion_logprobs([97, 98], [None, E(98, -1.0, (98,), (-1.0,))], STRINGS)[0]
    assert not has_missing(complete, False, start=0, echo=True)
    assert has_missing(complete, False, start=0, echo=False)
    # A later chunk's first entry is not the prompt's first.
    assert has_missing(complete, False, start=3, echo=True)
