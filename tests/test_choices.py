"""Several choices in one request: ``n`` > 1 and a batch of prompts (vLLM's parallel
sampling): each choice is its own request, answered as one body or one stream. And the
prompt cut to its last tokens (vLLM's ``truncate_prompt_tokens``), and special tokens'
text kept (``skip_special_tokens: false``): how prompts and answers map to text and
requests, on a node and through the proxy alike.

Unit tests check the parsing (limits, children and their seeds) and the merging helpers;
the live tests (slow) check that every choice a node or the proxy (P/D) answers is what a
single request for it answers on a colocated node, in one body and streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from harness import GREEDY, MODEL, PD, Proc, Procs, node_idle, sse_data, sse_events
from openai.types.chat import ChatCompletionChunk

from engine.httpkit.fanout import (
    gather_or_cancel,
    merge_bodies,
    merge_streams,
    opened_in_index_order,
    sum_usage,
)
from engine.httpkit.sse import SSE_DONE, SSEResponse, sse_event
from engine.server.chat_protocol import parse_chat_request
from engine.server.field_parsers import MAX_CHOICES
from engine.server.protocol import parse_completion_request
from engine.server.request_fields import APIError
from proxy.validation import validate_request

# -- parsing ---------------------------------------------------------------------------------------


def test_n_and_a_batch_make_one_child_per_choice_prompt_major_with_seed_plus_j() -> None:
    req = parse_completion_request({"prompt": ["ab", [5, 6]], "n": 3, "seed": 10})
    kids: list[Any] = req.children()
    assert req.num_choices == 6 and len(kids) == 6
    assert [(k.prompt_text, k.prompt_token_ids) for k in kids] == [("ab", None)] * 3 + [
        (None, [5, 6])
    ] * 3
    assert [k.seed for k in kids] == [10, 11, 12, 10, 11, 12]  # choice j of a prompt: seed + j
    assert all(k.n == 1 and k.batch is None for k in kids)
    chat = parse_chat_request({"messages": [{"role": "user", "content": "x"}], "n": 2})
    assert [k.seed for k in chat.children()] == [None, None]
    one = parse_completion_request({"prompt": ["ab"], "best_of": 1})  # a batch of one
    assert one.prompt_text == "ab" and one.batch is None and one.children() == [one]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "n": MAX_CHOICES + 1}, "n"),
        ({"prompt": ["a"] * (MAX_CHOICES // 2 + 1), "n": 2}, "n"),
        ({"prompt": ["a"] * (MAX_CHOICES + 1)}, "prompt"),
        ({"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
        ({"prompt": "a", "n": 2, "seed": 2**63 - 1}, "seed"),
        ({"prompt": ["a", ""]}, "prompt[1]"),
        ({"prompt": ["a", [1, "x"]]}, "prompt[1]"),
        ({"prompt": ["a", "b"], "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ],
)  # fmt: skip
def test_choices_are_bounded_where_the_request_enters(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion_request(body)
    assert e.value.status_code == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize("value", [0, -2, "5", 1.5])
def test_truncate_prompt_tokens_is_minus_one_or_positive(value: Any) -> None:
    with pytest.raises(APIError) as e:
        parse_completion_request({"prompt": "a", "truncate_prompt_tokens": value})
    assert e.value.param == "truncate_prompt_tokens"
    ok = parse_chat_request({"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 3})  # fmt: skip
    assert ok.truncate_prompt_tokens == 3


def test_the_proxy_makes_minus_one_the_decode_nodes_context_so_p_and_d_keep_the_same() -> None:
    body = b'{"prompt": "x", "truncate_prompt_tokens": -1, "n": 2}'
    req = validate_request("completions", body, ["m"], 100)
    assert req.body["truncate_prompt_tokens"] == 100
    assert [c.body["truncate_prompt_tokens"] for c in req.children] == [100, 100]


# -- merging -----------------------------------------------------------------------------------------


def test_usage_counts_each_prompt_once_and_every_choices_tokens() -> None:
    usages = [{"prompt_tokens": p, "completion_tokens": c} for p, c in [(4, 1), (4, 2), (7, 3), (7, 5)]]  # fmt: skip
    assert sum_usage(usages, 2) == {
        "prompt_tokens": 11,
        "completion_tokens": 11,
        "total_tokens": 22,
    }
    # Reasoning tokens (a chat answer on a node with a reasoning parser): summed when every
    # choice counted them; else the request has no count to give.
    counted = [{**u, "completion_tokens_details": {"reasoning_tokens": u["completion_tokens"] - 1}}
               for u in usages]  # fmt: skip
    assert sum_usage(counted, 2)["completion_tokens_details"] == {"reasoning_tokens": 7}
    assert "completion_tokens_details" not in sum_usage([*counted[:3], usages[3]], 2)
    bad = {**usages[3], "completion_tokens_details": {"reasoning_tokens": "4"}}
    assert "completion_tokens_details" not in sum_usage([*counted[:3], bad], 2)
    bodies = [{"id": "x", "choices": [{"index": 0, "text": t}], "usage": u} for t, u in zip("abcd", usages, strict=True)]  # fmt: skip
    merged = merge_bodies(bodies, 2)
    assert [(c["index"], c["text"]) for c in merged["choices"]] == list(enumerate("abcd"))
    assert merged["usage"]["prompt_tokens"] == 11 and merged["id"] == "x"


def test_merged_streams_keep_each_childs_order_and_leaving_early_ends_the_others() -> None:
    ended: list[int] = []

    async def child(i: int, n: int, wait: bool) -> AsyncIterator[int]:
        try:
            for k in range(n):
                if wait:
                    await asyncio.sleep(0.001 * (i + 1))
                yield k
            await asyncio.sleep(3600)  # a choice still running
            yield -1
        finally:
            ended.append(i)

    async def read(streams: list[AsyncIterator[int]], stop_after: int) -> list[tuple[int, int]]:
        ended.clear()
        got: list[tuple[int, int]] = []
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for item in merged:
                got.append(item)
                if len(got) == stop_after:
                    break
        assert sorted(ended) == list(range(len(streams)))  # every child's cleanup ran
        return got

    async def main() -> None:
        got = await read([child(0, 5, True), child(1, 3, True)], 8)
        assert [k for i, k in got if i == 0] == [0, 1, 2, 3, 4]
        assert [k for i, k in got if i == 1] == [0, 1, 2]
        # Children that are not waiting but held at a yield (the reader is slow) too.
        await read([child(0, 50, False), child(1, 50, False)], 2)

    asyncio.run(asyncio.wait_for(main(), 10))


def test_gather_or_cancel_raises_the_failure_and_cancels_the_rest() -> None:
    cleaned: list[str] = []

    async def slow() -> int:
        try:
            await asyncio.sleep(3600)
            return 1
        finally:
            cleaned.append("slow")

    async def bad() -> int:
        await asyncio.sleep(0.01)
        raise APIError("no", status_code=409)

    async def main() -> None:
        assert await gather_or_cancel([asyncio.sleep(0, 1), asyncio.sleep(0.01, 2)]) == [1, 2]
        with pytest.raises(APIError) as e:
            await gather_or_cancel([slow(), bad()])
        assert e.value.status_code == 409

    asyncio.run(asyncio.wait_for(main(), 10))
    assert cleaned == ["slow"]


# -- live: a node, and P/D behind the proxy --------------------------------------------------------

SAMPLED = {"temperature": 1.0, "ignore_eos": True, "max_tokens": 6}


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stream(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    body = {"model": MODEL, **body, "stream": True}
    with httpx.stream("POST", url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        return sse_events(resp)


def _by_index(events: list[Any], chat: bool) -> dict[int, tuple[str, list[int], Any]]:
    """Each choice's streamed text, ids and finish reason; every choice's role comes first."""
    out: dict[int, tuple[str, list[int], Any]] = {}
    for e in events:
        if not isinstance(e, dict):
            continue
        for c in e.get("choices") or []:
            text, ids, _ = out.get(c["index"], ("", [], None))
            if chat and c["index"] not in out:
                assert c["delta"].get("role") == "assistant", e
            piece = (c["delta"].get("content") or "") if chat else c["text"]
            out[c["index"]] = (text + piece, ids + (c.get("token_ids") or []), c["finish_reason"])
    return out


def _answer(choice: dict[str, Any], chat: bool) -> tuple[str, list[int], Any]:
    text = choice["message"]["content"] if chat else choice["text"]
    return text, choice["token_ids"], choice["finish_reason"]


def _wait_idle(urls: list[str]) -> None:
    """Every node at ``urls`` has no request left (aborts land within seconds)."""
    for url in urls:
        deadline = time.monotonic() + 20
        while not node_idle(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node_idle(url), url


def _target(pd: tuple[PD, Proc], through: str) -> tuple[PD, str, str]:
    """The pair, its colocated node's URL (the reference) and the URL a test sends to:
    that node (``through == "node"``) or the proxy in front of the pair."""
    pair, proxy = pd
    assert pair.colocated is not None
    ref = pair.colocated.url
    return pair, ref, ref if through == "node" else proxy.url


@pytest.fixture(scope="module")
def pd(module_procs: Procs) -> tuple[PD, Proc]:
    """A P/D pair behind a proxy, and a colocated node."""
    pair = module_procs.pd(1, 1, "--num-blocks", "256", colocated=True)
    return pair, module_procs.proxy([pair.p.url], [pair.d.url])


def _singles(url: str, path: str, body: dict[str, Any], prompts: list[Any], n: int) -> list[Any]:
    """What a single request answers for each choice: prompt ``i``, ``seed + j``."""
    chat = path.endswith("chat/completions")
    out = []
    for p in prompts:
        for j in range(n):
            one = {**body, "n": 1, "seed": body["seed"] + j}
            if not chat:
                one["prompt"] = p
            out.append(_answer(_post(url, path, one)["choices"][0], chat))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_every_choice_is_the_single_request_for_it(pd: tuple[PD, Proc], through: str) -> None:
    _, ref_url, url = _target(pd, through)
    prompts: list[Any] = ["hello there", [104, 105, 33, 32]]
    body = {**SAMPLED, "prompt": prompts, "n": 2, "seed": 7, "stream_options": None}
    want = _singles(ref_url, "/v1/completions", body, prompts, 2)
    assert len({w[0] for w in want}) > 1  # the seeds differ: so do the choices

    got = _post(url, "/v1/completions", body)
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    assert [_answer(c, False) for c in got["choices"]] == want
    prompt_tokens = len("hello there") + 4  # tiny: a byte a token; each prompt once
    assert got["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 24,
                            "total_tokens": prompt_tokens + 24}  # fmt: skip

    events = _stream(url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "DONE" and events.count("DONE") == 1
    assert events[-2]["usage"] == got["usage"] and events[-2]["choices"] == []
    assert len({e["id"] for e in events[:-1]}) == 1
    streamed = _by_index(events, chat=False)
    assert [streamed[i] for i in range(4)] == want

    chat = {**SAMPLED, "messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 3}
    want = _singles(ref_url, "/v1/chat/completions", chat, [None], 3)
    got = _post(url, "/v1/chat/completions", chat)
    assert [_answer(c, True) for c in got["choices"]] == want
    streamed = _by_index(_stream(url, "/v1/chat/completions", chat), chat=True)
    assert [streamed[i] for i in range(3)] == want


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_the_choices_of_one_prompt_compute_it_once(pd: tuple[PD, Proc], through: str) -> None:
    # Each choice is its own request; they arrive together, and all but one wait a step
    # for the prompt's blocks and take them from the prefix cache (on the colocated node,
    # or on the prefill node for the choices' prefill legs).
    pair, ref, url = _target(pd, through)
    computing = pair.colocated if through == "node" else pair.p
    assert computing is not None
    prompt = "The choices share this prompt. " * 10  # 310 bytes: tokens in tiny
    before = computing.metric("pdserve_prompt_tokens_total")
    body = {"prompt": prompt, "max_tokens": 2, "n": 4, "seed": 5, "temperature": 1.0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    computed = computing.metric("pdserve_prompt_tokens_total") - before
    assert computed <= len(prompt) + 1 + 3 * 48, computed  # + BOS; each other: < 3 blocks


@pytest.mark.parametrize("through", ["node", "proxy"])
def test_a_choice_that_cannot_run_refuses_the_request_and_leaves_nothing_running(
    pd: tuple[PD, Proc], through: str
) -> None:
    pair, _, url = _target(pd, through)
    body = {"model": MODEL, "prompt": ["fine", [1, 2, 100_000]], "max_tokens": 2}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "prompt[1]", resp.text
    _wait_idle([pair.colocated.url, pair.p.url, pair.d.url])


@pytest.mark.slow
def test_a_client_leaving_a_stream_of_choices_aborts_all_of_them(pd: tuple[PD, Proc]) -> None:
    pair, proxy = pd
    assert pair.colocated is not None
    # Through a node (the node aborts its choices) and the proxy (D's legs are aborted).
    for url, node in ((pair.colocated.url, pair.colocated), (proxy.url, pair.d)):
        limit = httpx.get(node.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
        body = {"model": MODEL, "prompt": "go", "n": 3, "max_tokens": limit - 8,
                "ignore_eos": True, "stream": True}  # fmt: skip
        before = node.logs(10**8).count("finished: abort")
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            seen: set[int] = set()
            for line in resp.iter_lines():  # read lazily: the stream is left half-read
                for event in sse_data([line]):
                    seen.update(c["index"] for c in event["choices"])
                if seen == {0, 1, 2}:
                    break  # every choice is running: leave
        deadline = time.monotonic() + 20
        while node.logs(10**8).count("finished: abort") - before < 3:
            assert time.monotonic() < deadline, node.logs(3000)
            time.sleep(0.05)
        _wait_idle([node.url])


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_a_priority_on_nodes_that_start_requests_in_arrival_order_is_refused(
    pd: tuple[PD, Proc], through: str
) -> None:
    # Not ignored: the client asked for an order the node does not keep (vLLM's rule);
    # through the proxy the prefill node's refusal is the client's 400.
    _, _, url = _target(pd, through)
    body = {"prompt": "Hello", "max_tokens": 3, "priority": 1, **GREEDY}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
    ok = httpx.post(url + "/v1/completions", json={**body, "priority": 0}, timeout=60)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("through", ["node", "proxy"])
def test_bad_words_keep_their_words_out_of_the_answer(pd: tuple[PD, Proc], through: str) -> None:
    # The tiny model's tokens are bytes; allowed_token_ids keeps it to eight letters, so
    # the answer is words the tokenizer makes.
    _, ref, url = _target(pd, through)
    letters = list(range(ord("a"), ord("i")))
    body = {"prompt": "Hello", "max_tokens": 40, "allowed_token_ids": letters, "seed": 3}

    def answer(target: str, **extra: Any) -> dict[str, Any]:
        resp = httpx.post(target + "/v1/completions", json={**body, **extra}, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]

    free = answer(ref)["text"]
    letter = max(set(free), key=free.count)
    pair = next(free[i : i + 2] for i in range(len(free) - 1) if letter not in free[i : i + 2])
    got = answer(url, bad_words=[letter, pair])
    assert letter not in got["text"] and pair not in got["text"], (free, got["text"])
    assert got["token_ids"] == answer(ref, bad_words=[letter, pair])["token_ids"]


@pytest.mark.parametrize("through", ["node", "proxy"])
def test_chat_echo_puts_the_final_message_before_the_answer_it_continues(
    pd: tuple[PD, Proc], through: str
) -> None:
    # vLLM's chat echo: with the final message in the answer's role (an assistant message
    # continued, or add_generation_prompt false), its text comes first; body and stream.
    _, ref, url = _target(pd, through)
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "My favourite colour is"},
    ]
    body = {"messages": messages, "max_tokens": 6, "continue_final_message": True,
            "add_generation_prompt": False, **GREEDY}  # fmt: skip
    plain = httpx.post(ref + "/v1/chat/completions", json=body, timeout=60).json()
    answer = plain["choices"][0]["message"]["content"]
    echoed = httpx.post(url + "/v1/chat/completions", json={**body, "echo": True}, timeout=60)
    assert echoed.status_code == 200, echoed.text
    choice = echoed.json()["choices"][0]
    assert choice["message"]["content"] == "My favourite colour is" + answer
    assert choice["token_ids"] == plain["choices"][0]["token_ids"]  # the answer's alone
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**body, "echo": True, "stream": True},
        timeout=60,
    ) as resp:  # fmt: skip
        assert resp.status_code == 200
        events = sse_events(resp)
    chunks = [e["choices"][0] for e in events if isinstance(e, dict) and e["choices"]]
    text = "".join(c["delta"].get("content") or "" for c in chunks)
    assert text == "My favourite colour is" + answer
    # The final message in another role than the answer's: nothing to echo.
    user_last = {"messages": messages[:1], "max_tokens": 6, "echo": True, **GREEDY}
    got = httpx.post(url + "/v1/chat/completions", json=user_last, timeout=60).json()
    alone = httpx.post(
        ref + "/v1/chat/completions", json={**user_last, "echo": False}, timeout=60
    ).json()
    assert got["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


@pytest.mark.parametrize("through", ["node", "proxy"])
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
    pd: tuple[PD, Proc], through: str
) -> None:
    _, ref, url = _target(pd, through)
    ids = list(range(97, 117))  # tiny: a byte a token, "abcdefghijklmnopqrst"
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    want = _post(ref, "/v1/completions", {**body, "prompt": ids[-5:]})["choices"][0]
    got = _post(url, "/v1/completions", {**body, "truncate_prompt_tokens": 5})
    assert got["choices"][0]["token_ids"] == want["token_ids"]
    assert got["usage"]["prompt_tokens"] == 5
    text = {**body, "prompt": "abcdefghijklmnopqrst", "truncate_prompt_tokens": 5, "echo": True}
    assert _post(url, "/v1/completions", text)["choices"][0]["text"] == "pqrst" + want["text"]
    chat = {"messages": [{"role": "user", "content": "hi " * 20}], "max_tokens": 2,
            "truncate_prompt_tokens": 7}  # fmt: skip
    assert _post(url, "/v1/chat/completions", chat)["usage"]["prompt_tokens"] == 7
    # -1: the context's length (this prompt is shorter: kept whole); past it, a 400.
    whole = _post(url, "/v1/completions", {**body, "truncate_prompt_tokens": -1})
    assert whole["usage"]["prompt_tokens"] == 20
    limit = httpx.get(ref + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    resp = httpx.post(
        url + "/v1/completions", json={"model": MODEL, **body, "truncate_prompt_tokens": limit + 1}
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_skip_special_tokens_false_keeps_their_text(pd: tuple[PD, Proc], through: str) -> None:
    """tiny's BOS (256) is special: its text is left out unless asked (vLLM's default)."""
    pair, _, url = _target(pd, through)
    body = {"prompt": [256, 104, 105], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {"256": 100}}  # fmt: skip
    plain = _post(url, "/v1/completions", body)["choices"][0]
    assert plain["token_ids"] == [256] * 3 and plain["text"] == ""
    kept = {**body, "skip_special_tokens": False}
    assert _post(url, "/v1/completions", kept)["choices"][0]["text"] == "<|bos|>" * 3
    streamed = _by_index(_stream(url, "/v1/completions", kept), chat=False)
    assert streamed[0][0] == "<|bos|>" * 3
    echo = _post(url, "/v1/completions", {**kept, "echo": True})["choices"][0]["text"]
    assert echo == "<|bos|>hi" + "<|bos|>" * 3


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_continue_final_message_goes_on_with_the_prefilled_answer(
    pd: tuple[PD, Proc], through: str
) -> None:
    """vLLM's ``continue_final_message``: the prompt ends inside the assistant's message
    (tiny's built-in template), as a completion of that text answers."""
    pair, _, url = _target(pd, through)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    chat = {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "continue_final_message": True}  # fmt: skip
    text = "<|user|>\nhi\n<|assistant|>\nHel"
    want = _post(pair.colocated.url, "/v1/completions", {**chat, "prompt": text, "messages": None})
    got = _post(url, "/v1/chat/completions", chat)
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert got["usage"]["prompt_tokens"] == len(text)
    closed = {**chat, "continue_final_message": False, "add_generation_prompt": False}
    assert _post(url, "/v1/chat/completions", closed)["usage"]["prompt_tokens"] == len(text) + 1
    count = httpx.post(
        url + "/tokenize", json={"messages": messages, "continue_final_message": True}
    )
    assert count.json()["count"] == len(text), count.text


@pytest.mark.slow
def test_the_proxy_counts_every_choice_against_max_inflight(
    module_procs: Procs, pd: tuple[PD, Proc]
) -> None:
    pair, _ = pd
    proxy = module_procs.proxy([pair.p.url], [pair.d.url], "--max-inflight", "2")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2}
    assert httpx.post(proxy.url + "/v1/completions", json=body, timeout=60).status_code == 200
    resp = httpx.post(proxy.url + "/v1/completions", json={**body, "n": 3}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n", resp.text
    assert "--max-inflight" in resp.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_prompt_logprobs_are_vllms_shape_and_p_d_answers_them_as_colocated(
    pd: tuple[PD, Proc], through: str
) -> None:
    """vLLM's ``prompt_logprobs``: per prompt token null (the first) or the token's and the
    ``k`` most likely ones' log probability, rank and text; through the proxy P's (D did
    not compute the prompt); with ``echo`` + ``logprobs`` each keeps its own count."""
    pair, _, url = _target(pd, through)
    body = {"prompt": "hello there", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "prompt_logprobs": 2}  # fmt: skip
    got = _post(url, "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    ref = _post(pair.colocated.url, "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    assert len(got) == len("hello there") and got[0] is None
    for i, (entry, want) in enumerate(zip(got[1:], ref[1:], strict=True), 1):
        token = str(ord("hello there"[i]))
        assert next(iter(entry)) == token and entry[token]["decoded_token"] == "hello there"[i]
        ranks = sorted(v["rank"] for k, v in entry.items() if k != token)
        assert ranks[:2] == [1, 2] and entry[token]["rank"] >= 1
        assert entry.keys() == want.keys()
        assert all(abs(entry[k]["logprob"] - want[k]["logprob"]) < 1e-4 for k in entry)
    both = _post(url, "/v1/completions", {**body, "echo": True, "logprobs": 1})["choices"][0]
    assert all(len(t) <= 2 for t in both["logprobs"]["top_logprobs"][1:])  # logprobs: 1
    assert len(both["prompt_logprobs"][1]) >= 2
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    answer = _post(url, "/v1/chat/completions", chat)
    assert answer["prompt_logprobs"][0] is None and all(len(e) == 1 for e in answer["prompt_logprobs"][1:])  # fmt: skip
    resp = httpx.post(url + "/v1/completions", json={"model": MODEL, **body, "stream": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(
    pd: tuple[PD, Proc], through: str
) -> None:
    pair, _, url = _target(pd, through)
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    events = [e for e in _stream(url, "/v1/completions", body) if isinstance(e, dict)]
    final = events[-1]["usage"]
    assert final == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    seen = 0
    for e in events[:-1]:
        usage = e["usage"]
        seen += sum(len(c.get("token_ids") or []) for c in e["choices"])
        assert usage == {"prompt_tokens": 5, "completion_tokens": seen, "total_tokens": 5 + seen}
    assert seen == 6
    plain = {**body, "stream_options": {"include_usage": True}}
    assert all(e["usage"] is None for e in _stream(url, "/v1/completions", plain)[:-2])


@pytest.mark.slow
def test_each_choice_counts_against_the_nodes_bound_on_requests_held(module_procs: Procs) -> None:
    """``--max-num-seqs`` + ``--max-queued-requests`` (3 here) bounds engine requests:
    a request with more choices than that is a 400, one whose choices do not fit beside
    what runs a 429, and a finished request gives its places back."""
    node = module_procs.node(
        "--model", MODEL, "--num-blocks", "256", "--max-num-seqs", "2", "--max-queued-requests", "1"
    )
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    url = node.url + "/v1/completions"
    resp = httpx.post(url, json={**body, "n": 4}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n", resp.text
    assert len(httpx.post(url, json={**body, "n": 3}, timeout=60).json()["choices"]) == 3
    limit = httpx.get(node.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    long = {**body, "max_tokens": limit - 8, "stream": True}
    with httpx.stream("POST", url, json=long, timeout=60) as running:  # holds one place
        assert running.status_code == 200
        lines = running.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)
        busy = httpx.post(url, json={**body, "n": 3}, timeout=60)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1", busy.text
        assert len(httpx.post(url, json={**body, "n": 2}, timeout=60).json()["choices"]) == 2
    _wait_idle([node.url])
    for stream in (False, True):  # every place came back: three choices fit again
        resp = httpx.post(url, json={**body, "n": 3, "stream": stream}, timeout=60)
        assert resp.status_code == 200, resp.text
    assert node.metric("pdserve_num_requests_admitted") == 0


def test_an_exception_a_child_yields_is_an_item_and_one_it_raises_ends_the_merge() -> None:
    """A choice reports its failure as its last item (an ``APIError``, sent as its error
    event); only an exception the child raises ends the merge."""

    async def yields() -> AsyncIterator[Any]:
        yield APIError("engine unavailable", status_code=503)

    async def raises() -> AsyncIterator[Any]:
        yield 1
        raise ValueError("broken")

    async def main() -> None:
        got = [item async for item in merge_streams([yields()])]
        assert len(got) == 1 and isinstance(got[0][1], APIError)
        assert got[0][1].status_code == 503
        with pytest.raises(ValueError):
            async for _ in merge_streams([raises()]):
                pass

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_stream_whose_client_left_before_its_first_byte_still_runs_its_cleanup() -> None:
    """The response's ``on_close`` runs when the body never started (the generator's own
    ``finally`` does not): the node's admission places and aborts hang on it."""
    started: list[bool] = []
    closed: list[bool] = []

    async def body() -> AsyncIterator[str]:
        started.append(True)
        yield "data: x\n\n"

    async def on_close() -> None:
        closed.append(True)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await asyncio.sleep(0.05)

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST"}
    response = SSEResponse(body(), on_close=on_close)
    asyncio.run(asyncio.wait_for(response(scope, receive, send), 10))
    assert closed == [True] and started == []


def test_a_stream_of_choices_opens_them_in_index_order_as_vllm_and_the_openai_stream_helper_need() -> (
    None
):
    """vLLM sends every choice's first chunk (the role) in index order before any other;
    the ``openai`` package's ``chat.completions.stream`` helper relies on it (a choice
    first seen before a lower one is an ``IndexError`` in its accumulator). Through the
    proxy each choice is its own P/D pair, so choice 1's first chunk may arrive first."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    from proxy.choices import events_all

    def chunk(i: int, delta: dict[str, Any], finish: str | None = None) -> str:
        c = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}
        body = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [c]}  # fmt: skip
        return sse_event(body)

    class FakeSession:
        def __init__(self, i: int, wait: float) -> None:
            self.index, self.wait, self.outcome, self.usage = i, wait, "ok", None
            self.req = SimpleNamespace(parsed=SimpleNamespace(include_usage=False))

        async def events(self) -> AsyncIterator[str]:
            await asyncio.sleep(self.wait)  # choice 1's leg answers first
            yield chunk(self.index, {"role": "assistant", "content": ""})
            yield chunk(self.index, {"content": f"c{self.index}"})
            yield chunk(self.index, {}, "stop")
            yield SSE_DONE

    async def main() -> list[str]:
        sessions: Any = [FakeSession(0, 0.2), FakeSession(1, 0.0)]
        return [e async for e in events_all(sessions, 2)]

    events = asyncio.run(asyncio.wait_for(main(), 10))
    chunks = [c for c in sse_data(ln for e in events for ln in e.splitlines()) if c != "DONE"]
    firsts = list(dict.fromkeys(c["choices"][0]["index"] for c in chunks))
    assert firsts == [0, 1]
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    done = state.get_final_completion()
    assert [(ch.index, ch.message.content) for ch in done.choices] == [(0, "c0"), (1, "c1")]


def test_held_back_choices_keep_their_order_and_an_urgent_item_passes_at_once() -> None:
    async def items(pairs: list[tuple[int, str]]) -> AsyncIterator[tuple[int, str]]:
        for p in pairs:
            yield p

    async def run(pairs: list[tuple[int, str]]) -> list[tuple[int, str]]:
        ordered = opened_in_index_order(items(pairs), urgent=lambda s: s == "err")
        return [p async for p in ordered]

    got = asyncio.run(run([(2, "a"), (1, "b"), (2, "c"), (0, "d"), (1, "e")]))
    assert got == [(0, "d"), (1, "b"), (2, "a"), (2, "c"), (1, "e")]
    assert asyncio.run(run([(1, "a"), (1, "err")])) == [(1, "err"), (1, "a")]
    # A child that never yields does not hold the others back past the end.
    assert asyncio.run(run([(2, "a"), (1, "b")])) == [(1, "b"), (2, "a")]
