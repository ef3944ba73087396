"""The offline ``LLM`` in vLLM's shape (``engine/llm.py``): text and chat answers equal a
node's for the same request (the node's app and engine in this process, ``uni``
executors: no process starts), stop strings, per-prompt parameters, ``n``, log
probabilities, and the keyword arguments (``engine/llm_args.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine import LLM, CompletionOutput, RequestOutput, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.llm_args import config_keywords, engine_config

PROMPTS = ["Hello, my name is", "The capital of France is", "abc"]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(model="tiny", device="cpu", num_blocks=256, max_model_len=512) as engine:
        yield engine


@pytest.fixture(scope="module")
def node() -> Iterator[Any]:
    """A node's app on the same model: what ``decode-node --model tiny`` answers. Its
    requests run on one event loop, kept open between them (the engine thread delivers
    the outputs of a request the node aborted -- a stop string's -- to the loop it began on)."""
    from inproc_node import app_on_loop, uni_config

    with app_on_loop(uni_config(max_model_len=512, num_blocks=256)) as node:
        yield node


def _post(node: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    app, loop = node

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://n") as client:
            return await client.post(path, json={"model": "tiny", **body})

    resp = loop.run_until_complete(main())
    assert resp.status_code == 200, resp.text[:300]
    return resp.json()


def _same(out: CompletionOutput, choice: dict[str, Any], chat: bool = False) -> None:
    text = choice["message"]["content"] if chat else choice["text"]
    assert (out.text, out.finish_reason, out.stop_reason) == (
        text, choice["finish_reason"], choice["stop_reason"],
    )  # fmt: skip
    assert out.token_ids == choice["token_ids"]


def test_text_answers_are_a_nodes(llm: LLM, node: Any) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    assert [o.prompt for o in outs] == PROMPTS
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert isinstance(out, RequestOutput) and out.finished
        assert out.prompt_token_ids == list(prompt.encode())  # the byte tokenizer's ids
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
        (choice,) = _post(node, "/v1/completions", body)["choices"]
        _same(out.outputs[0], choice)
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 16


def test_stop_strings_end_the_answer_as_on_a_node(llm: LLM, node: Any) -> None:
    prompt = "abc"
    (free,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))
    full = free.outputs[0].text
    # Two letters after the answer's start (the tiny model's greedy text of "abc" has some).
    stop = next(full[i : i + 2] for i in range(3, len(full) - 1) if full[i : i + 2].isalpha())
    for include in (False, True):
        sp = SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                            include_stop_str_in_output=include)  # fmt: skip
        (out,) = llm.generate(prompt, sp)
        got = out.outputs[0]
        cut = full.index(stop) + (len(stop) if include else 0)
        assert got.text == full[:cut]
        assert (got.finish_reason, got.stop_reason) == ("stop", stop)
        assert len(got.token_ids) < 24  # the engine request was cut at the stop string
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": [stop],
                "include_stop_str_in_output": include, "return_token_ids": True}  # fmt: skip
        (choice,) = _post(node, "/v1/completions", body)["choices"]
        _same(got, choice)
    # The engine requests were cut short; the next call starts from an idle engine.
    (again,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))
    assert again.outputs == free.outputs


def test_stop_strings_count_as_stop_in_the_metrics(llm: LLM) -> None:
    """An answer a stop string ended is a "stop" in ``request_success_total`` (vLLM's):
    one cut mid-answer (its engine request aborted) and one whose stop string came with
    its last token (the engine ended it by its length)."""
    (free,) = llm.generate("abc", SamplingParams(temperature=0, max_tokens=24))
    full, ids = free.outputs[0].text, free.outputs[0].token_ids
    mid = next(full[i : i + 2] for i in range(3, len(full) - 4) if full[i : i + 2].isalpha())
    # A token that is an ASCII character new to the answer: the answer cut there ends with it.
    k = next(k for k in range(2, len(ids)) if 33 <= ids[k] < 127 and ids[k] not in ids[:k])

    def success() -> dict[str, float]:
        entry = next(e for e in llm.stats().entries() if e.name == "request_success_total")
        return dict(entry.by_label)

    before = success()
    (cut,) = llm.generate("abc", SamplingParams(temperature=0, max_tokens=24, stop=[mid]))
    assert cut.outputs[0].finish_reason == "stop"
    sp = SamplingParams(temperature=0, max_tokens=k + 1, stop=[chr(ids[k])])
    (ended,) = llm.generate("abc", sp)
    assert ended.outputs[0].finish_reason == "stop"
    after = success()
    assert {r: after[r] - before[r] for r in after} == {"stop": 2, "length": 0, "abort": 0}


def test_a_stop_string_cut_leaves_an_async_scheduling_engine_idle() -> None:
    """With a step in flight when a stop string ends a request, the next call gets none of
    its outputs and the engine's blocks are back; the answers are a synchronous engine's."""
    greedy = SamplingParams(temperature=0, max_tokens=24)
    with LLM(model="tiny", device="cpu", num_blocks=256, max_model_len=512,
             async_scheduling=False) as sync:  # fmt: skip
        (want,) = sync.generate("abc", greedy)
    stop = want.outputs[0].text[4:6]
    with LLM(model="tiny", device="cpu", num_blocks=256, max_model_len=512,
             async_scheduling=True) as asyn:  # fmt: skip
        (cut,) = asyn.generate("abc", SamplingParams(temperature=0, max_tokens=24, stop=stop))
        assert cut.outputs[0].finish_reason == "stop"
        assert asyn.generate(["abc", "q"], greedy)[0].outputs == want.outputs
        assert not asyn.core.has_work()


def test_chat_answers_are_a_nodes(llm: LLM, node: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    sp = SamplingParams(temperature=0, max_tokens=8)
    (out,) = llm.chat(messages, sp)
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    resp = _post(node, "/v1/chat/completions", body)
    _same(out.outputs[0], resp["choices"][0], chat=True)
    assert out.prompt_token_ids == resp["prompt_token_ids"]
    assert out.prompt is not None and out.prompt.endswith("<|assistant|>\n")
    # A list of conversations: one output each, in order.
    both = llm.chat([messages, [{"role": "user", "content": "yo"}]], sp)
    assert len(both) == 2 and both[0].outputs == out.outputs
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(messages, sp, chat_template_kwargs={"enable_thinking": False})


def test_per_prompt_params_prompt_forms_and_n(llm: LLM, node: Any) -> None:
    short = SamplingParams(temperature=0, max_tokens=3)
    long = SamplingParams(temperature=0, max_tokens=7)
    ids = list(b"abc")
    outs = llm.generate(["abc", {"prompt_token_ids": ids}, {"prompt": "abc"}], [short, long, short])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7, 3]
    assert outs[1].prompt is None and outs[1].prompt_token_ids == ids
    assert outs[1].outputs[0].token_ids[:3] == outs[0].outputs[0].token_ids
    assert outs[2].outputs == outs[0].outputs
    assert llm.generate_token_ids([ids], long) == [outs[1].outputs[0].token_ids]
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [short, long])
    # n: answer j seeded seed + j, as a node's choices.
    sp = SamplingParams(temperature=0.9, max_tokens=6, n=2, seed=7)
    (out,) = llm.generate("abc", sp)
    assert [o.index for o in out.outputs] == [0, 1]
    body = {"prompt": "abc", "max_tokens": 6, "temperature": 0.9, "n": 2, "seed": 7,
            "return_token_ids": True}  # fmt: skip
    choices = sorted(_post(node, "/v1/completions", body)["choices"], key=lambda c: c["index"])
    for got, choice in zip(out.outputs, choices, strict=True):
        _same(got, choice)


def test_logprobs_in_vllms_shape(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1)
    (out,) = llm.generate("abcd", sp)
    answer = out.outputs[0]
    assert answer.logprobs is not None and len(answer.logprobs) == 4
    for token, position in zip(answer.token_ids, answer.logprobs, strict=True):
        assert token in position and position[token].rank == 1  # greedy: the most likely
        assert {p.rank for p in position.values()} <= {1, 2}
    assert answer.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(answer.token_ids, answer.logprobs, strict=True))
    )
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 4
    assert out.prompt_logprobs[0] is None and ord("b") in out.prompt_logprobs[1]
    (plain,) = llm.generate("abcd", SamplingParams(temperature=0, max_tokens=4))
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None


def test_vllm_keywords_map_to_the_config() -> None:
    cfg = engine_config(
        "tiny", tensor_parallel_size=1, dtype="half", seed=3, max_model_len="2k",
        max_num_seqs=8, max_num_batched_tokens=512, gpu_memory_utilization=0.5,
        enforce_eager=True, block_size=32, enable_prefix_caching=False,
        trust_remote_code=True, revision=None, tokenizer="tiny", device="cpu",
        enable_chunked_prefill=True,
    )  # fmt: skip
    assert (cfg.model.model, cfg.model.dtype, cfg.model.seed, cfg.model.max_model_len) == (
        "tiny", "float16", 3, 2000,
    )  # fmt: skip
    assert (cfg.parallel.tp, cfg.parallel.device, cfg.model.enforce_eager) == (1, "cpu", True)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (8, 512)
    assert (cfg.cache.block_size, cfg.cache.enable_prefix_caching) == (32, False)
    assert cfg.cache.gpu_memory_utilization == 0.5
    # Every config field is a keyword, by its flag's name (no second list of names).
    assert {"kv_role", "scheduling_policy", "async_scheduling", "tp"} <= set(config_keywords())
    kv = engine_config(
        kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    )
    assert (kv.kv_transfer.kv_connector, kv.kv_transfer.kv_role) == ("nixl", "consumer")


def test_async_scheduling_is_on_unless_turned_off_and_the_engine_says_which(caplog) -> None:
    from engine.config import SchedulerConfig

    assert SchedulerConfig().async_scheduling is True  # vLLM's default (unset: None)
    assert EngineConfig().scheduler.async_scheduling is True
    assert engine_config().scheduler.async_scheduling is True
    assert engine_config(async_scheduling=None).scheduler.async_scheduling is True
    assert engine_config(async_scheduling=False).scheduler.async_scheduling is False
    with pytest.raises(ConfigError, match="async_scheduling='no': must be bool"):
        engine_config(async_scheduling="no")
    for kwargs, line in (
        ({}, "async scheduling: on (the default"),
        ({"async_scheduling": False}, "async scheduling: off (--no-async-scheduling"),
    ):
        caplog.clear()
        with (
            caplog.at_level("INFO", logger="engine.engine_core"),
            LLM(model="tiny", device="cpu", num_blocks=64, max_model_len=256, **kwargs) as llm,
        ):
            assert llm.core.scheduler.async_scheduling is kwargs.get("async_scheduling", True)
        assert any(r.getMessage().startswith(line) for r in caplog.records), caplog.text


def test_bad_keywords_are_refused_before_an_engine_starts() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument.*quantization, swap_space"):
        LLM(model="tiny", swap_space=4, quantization="awq")
    with pytest.raises(TypeError, match="tp twice"):
        LLM(model="tiny", tp=1, tensor_parallel_size=1)
    with pytest.raises(TypeError, match="not both"):
        LLM(config=EngineConfig(), max_num_seqs=4)
    with pytest.raises(ConfigError, match="--block-size"):
        LLM(model="tiny", block_size=3)
    with pytest.raises(ConfigError, match="enable_chunked_prefill"):
        LLM(model="tiny", enable_chunked_prefill=False)
    with pytest.raises(ConfigError, match="tokenizer"):
        LLM(model="tiny", tokenizer="org/other")


def test_out_of_vocabulary_prompt_ids_are_refused_and_the_engine_stays_usable(llm: LLM) -> None:
    """vLLM's: a prompt id outside [0, vocab) is a ValueError at submission, not a failed
    step (an out-of-range embedding index; on CUDA a device assert); the call's other
    prompts never start, the next call runs."""
    greedy = SamplingParams(temperature=0, max_tokens=2)
    vocab = llm.core.arch.vocab_size
    for bad in ([1, vocab], [-1, 5], {"prompt_token_ids": [vocab + 7]}):
        with pytest.raises(ValueError, match="out of range"):
            llm.generate(["abc", bad], greedy)  # type: ignore[list-item]
        with pytest.raises(ValueError, match="out of range"):
            llm.generate_token_ids([[97], bad if isinstance(bad, list) else [vocab]], greedy)
    assert not llm.core.has_work()
    assert (
        llm.generate("abc", greedy)[0].outputs[0].token_ids
        == llm.generate_token_ids([list(b"abc")], greedy)[0]
    )


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"block_size": "x"}, "block_size"),
        ({"max_num_seqs": None}, "max_num_seqs"),
        ({"max_num_seqs": "8"}, "max_num_seqs"),
        ({"enforce_eager": "yes"}, "enforce_eager"),
        ({"seed": "x"}, "seed"),
        ({"dtype": "float7"}, "dtype"),
        ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization"),
        ({"tensor_parallel_size": 1.0}, "tensor_parallel_size"),
    ],
)
def test_a_keywords_bad_type_is_a_config_error_naming_it(
    kwargs: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        engine_config("tiny", device="cpu", **kwargs)


def test_vllms_other_value_types_dtype_and_served_model_name() -> None:
    import torch

    assert engine_config("tiny", dtype=torch.bfloat16).model.dtype == "bfloat16"
    assert engine_config("tiny", dtype=torch.half).model.dtype == "float16"
    assert engine_config("tiny", served_model_name="a").model.served_model_name == ("a",)


def test_a_priority_list_of_the_wrong_length_is_named(llm: LLM) -> None:
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=1), priority=[0])
    with pytest.raises(ValueError, match="priority"):
        llm.generate_token_ids([[97], [98]], SamplingParams(max_tokens=1), priority=[0])
    assert not llm.core.has_work()


def test_sampling_params_bad_stop_and_n_name_the_field() -> None:
    for kwargs in ({"stop": 5}, {"stop": ["a", 1]}, {"n": True}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SamplingParams(**kwargs)


def test_max_tokens_none_runs_to_the_context_as_vllms(llm: LLM) -> None:
    """vLLM's ``SamplingParams(max_tokens=None)``: the answer may run to the end of the
    context (``max_model_len`` less the prompt)."""
    sp = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate(["abc"], sp)
    prompt_len = len(out.prompt_token_ids)
    assert len(out.outputs[0].token_ids) == 512 - prompt_len
    assert out.outputs[0].finish_reason == "length"
    (ids,) = llm.generate_token_ids([[97, 98]], sp)
    assert len(ids) == 510
    assert sp.max_tokens is None  # the caller's params are not changed
    assert not llm.core.has_work()


def test_an_empty_stop_string_is_refused_as_vllm_refuses_it() -> None:
    for stop in ("", ["a", ""]):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=stop)


def test_a_bad_message_of_a_later_conversation_names_its_conversation(llm: LLM) -> None:
    good = [{"role": "user", "content": "hi"}]
    bad = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]
    with pytest.raises(ValueError, match=r"^conversation 1: 'messages\[1\]\.role'"):
        llm.chat([good, bad])
    with pytest.raises(ValueError, match=r"^'messages\[1\]\.role'"):  # one conversation
        llm.chat(bad)
    assert not llm.core.has_work()
