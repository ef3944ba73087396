"""Prefix-aware routing and conditional disaggregation without processes: the prompt
keys, the per-node prefix index (bounded, LRU, dropped on reset), the token estimate,
the cache-aware policy and the router's decode-only decision."""

from __future__ import annotations

import argparse
import json
import tracemalloc
from typing import Any

import pytest

from engine.server.chat_protocol import parse_chat_request
from engine.server.protocol import parse_completion_request
from proxy.config import ProxyConfig, ProxyConfigError, add_proxy_args, config_from_sources
from proxy.nodes import NodePool
from proxy.prefix import (
    CHAR_BLOCK,
    ID_BLOCK,
    PrefixIndex,
    PromptKey,
    TokenEstimator,
    answer_suffix,
    prompt_key,
)
from proxy.router import CacheAware, LeastOutstanding, NoHealthyNode, RoundRobin, Router

P, D = "http://10.0.0.1:8100", "http://10.0.0.2:8200"
LONG = "".join(f"word{i} " for i in range(200))  # ~1,400 characters


def _cfg(*argv: str) -> ProxyConfig:
    parser = argparse.ArgumentParser()
    add_proxy_args(parser)
    return config_from_sources(parser.parse_args(["--prefill", P, "--decode", D, *argv]), {})


def _pool(n_p: int, n_d: int) -> NodePool:
    pool = NodePool(
        tuple(f"http://p{i}:1" for i in range(n_p)), tuple(f"http://d{i}:1" for i in range(n_d))
    )
    for n in pool.all():
        n.model, n.side_channel = "tiny", "tcp://x:1"
        n.set_healthy(True)
    return pool


def _text(s: str) -> PromptKey:
    return PromptKey.of("text", s)


# -- keys --------------------------------------------------------------------------------------


def test_keys_share_blocks_exactly_as_far_as_the_text_does() -> None:
    a, b = _text(LONG + "first question"), _text(LONG + "second one")
    shared = len(LONG) // CHAR_BLOCK
    assert a.hashes[:shared] == b.hashes[:shared]
    assert a.hashes[shared:] != b.hashes[shared:] or len(a.hashes) == shared
    assert len(a.hashes) == a.length // CHAR_BLOCK and a.length == len(LONG) + 14
    # A short prompt has no full block: nothing to match.
    assert _text("Hello").hashes == ()
    # Extending a key equals keying the concatenation (what an answer appends).
    assert _text(LONG).extend("tail " * 40) == _text(LONG + "tail " * 40)
    ids = list(range(100))
    assert PromptKey.of("ids", ids[:40]).extend(ids[40:]) == PromptKey.of("ids", ids)
    assert len(PromptKey.of("ids", ids).hashes) == 100 // ID_BLOCK
    # Kinds never share blocks, even with the same content.
    assert _text("x" * 200).hashes[0] != PromptKey.of("chat", "x" * 200).hashes[0]


def test_prompt_keys_of_requests() -> None:
    comp = parse_completion_request({"prompt": LONG})
    assert prompt_key(comp) == _text(LONG)
    ids = parse_completion_request({"prompt": list(range(50))})
    assert prompt_key(ids).kind == "ids" and prompt_key(ids).length == 50
    turn1 = [{"role": "system", "content": LONG}, {"role": "user", "content": "hi"}]
    k1 = prompt_key(parse_chat_request({"messages": turn1}))
    turn2 = [*turn1, {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "more"}]  # fmt: skip
    k2 = prompt_key(parse_chat_request({"messages": turn2}))
    assert k1.kind == "chat" and k2.hashes[: len(k1.hashes)] == k1.hashes
    # The answer suffix continues the conversation's key.
    grown = k1.extend(answer_suffix(k1, "hello there", [1, 2]))
    assert k2.hashes[: len(grown.hashes)] == grown.hashes
    assert answer_suffix(prompt_key(ids), "x", [7, 8]) == [7, 8]


# -- answers with tool calls or reasoning ------------------------------------------------------

NOTE = [{"type": "function", "function": {"name": "note"}}]
TURN1 = [{"role": "system", "content": LONG}, {"role": "user", "content": "note it down"}]


def _call(text: str, spaced: bool = True) -> dict[str, Any]:
    args = json.dumps({"text": text}, separators=(", ", ": ") if spaced else (",", ":"))
    return {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "note", "arguments": args}}  # fmt: skip


def _next_turn(call: dict[str, Any], content: str | None = None) -> PromptKey:
    """The key of the turn after an answer ``call``: the client sends the call back, then
    the tool's result."""
    msgs = [*TURN1, {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "done"}]  # fmt: skip
    return prompt_key(parse_chat_request({"messages": msgs, "tools": NOTE}))


def test_a_tool_call_answer_is_learned_as_the_next_turn_keys_it() -> None:
    """The chat template renders an assistant message's tool calls into the next turn's
    prompt (after its content), and the decode node cached them as it generated them: the
    key has them, and the answer's key continues with them."""
    k1 = prompt_key(parse_chat_request({"messages": TURN1, "tools": NOTE}))
    a, b = _call("a" * 300), _call("b" * 300)
    # Two conversations that differ only in the call the assistant made part there (the
    # text after the first assistant message was one key for both).
    ka, kb = _next_turn(a), _next_turn(b)
    parted = next(i for i, (x, y) in enumerate(zip(ka.hashes, kb.hashes, strict=True)) if x != y)
    assert parted < len(k1.hashes) + 2 and ka.length > k1.length + 300
    # The answer (content "" or some, and the call as the stream or body sent it) grows
    # the key as far as the next turn repeats it: the call's blocks included.
    for content in ("", "Noting."):
        learned = k1.extend(answer_suffix(k1, content, [1, 2], calls=[a]))
        assert len(learned.hashes) > len(k1.hashes) + 300 // CHAR_BLOCK - 1
        for call in (a, _call("a" * 300, spaced=False)):  # arguments as JSON, not as text
            nxt = _next_turn(call, content or None)
            assert nxt.hashes[: len(learned.hashes)] == learned.hashes
        assert _next_turn(b, content or None).hashes[: len(learned.hashes)] != learned.hashes
    # Arguments that are not a JSON object stay text, on both sides.
    odd = {**a, "function": {"name": "note", "arguments": "not json"}}
    learned = k1.extend(answer_suffix(k1, "", [1], calls=[odd]))
    assert _next_turn(odd).hashes[: len(learned.hashes)] == learned.hashes


def test_chat_keys_part_where_the_tools_or_template_variables_differ() -> None:
    """Templates render the request's tools (and its ``chat_template_kwargs``) before the
    messages: the same messages with other tools are another prompt from its start, so
    their keys share nothing; with the same ones, a conversation's turns still extend."""
    other = [{"type": "function", "function": {"name": "erase"}}]

    def key(msgs: list[dict[str, Any]], **extra: Any) -> PromptKey:
        return prompt_key(parse_chat_request({"messages": msgs, **extra}))

    plain, noted, erased = key(TURN1), key(TURN1, tools=NOTE), key(TURN1, tools=other)
    thinking = key(TURN1, chat_template_kwargs={"enable_thinking": False})
    firsts = {k.hashes[0] for k in (plain, noted, erased, thinking)}
    assert len(firsts) == 4
    assert key(TURN1, tools=NOTE) == noted
    learned = noted.extend(answer_suffix(noted, "Noting.", [1]))
    turn2 = [*TURN1, {"role": "assistant", "content": "Noting."}, {"role": "user", "content": "x"}]
    assert key(turn2, tools=NOTE).hashes[: len(learned.hashes)] == learned.hashes


def test_an_answer_with_reasoning_is_not_learned() -> None:
    """The next turn's prompt leaves the reasoning out (``reasoning_content`` is not sent
    to the template), while the decode node cached it right after the prompt: nothing of
    the answer is in its cache as the next turn renders it."""
    k1 = prompt_key(parse_chat_request({"messages": TURN1}))
    assert answer_suffix(k1, "The answer. " * 20, [1], reasoned=True) == ""
    assert answer_suffix(k1, "The answer. ", [1], reasoned=False) != ""


def test_the_proxys_stream_keeps_the_answers_calls_and_reasoning() -> None:
    """What the session learns from a stream: its calls put together from the deltas, and
    whether it had reasoning."""
    from proxy.client_stream import ClientStream
    from proxy.validation import CHAT, validate_request

    raw = json.dumps({"messages": TURN1, "tools": NOTE, "stream": True}).encode()
    out = ClientStream(validate_request(CHAT, raw, ["m"], None), "r", 0, False)
    a = _call("a" * 30)
    args = a["function"]["arguments"]
    deltas = [{"content": "Noting."},
              {"tool_calls": [{"index": 0, "id": a["id"], "type": "function",
                               "function": {"name": "note", "arguments": args[:5]}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": args[5:20]}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": args[20:]}}]}]  # fmt: skip
    for i, d in enumerate(deltas):
        out.rewrite({"choices": [{"index": 0, "delta": d, "token_ids": [i],
                                  "finish_reason": None}]})  # fmt: skip
    assert out.answer() == ("Noting.", [0, 1, 2, 3])
    assert out.answer_calls == [a] and not out.reasoned
    out.rewrite({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"},
                              "token_ids": [4], "finish_reason": None}]})  # fmt: skip
    assert out.reasoned


# -- the index ---------------------------------------------------------------------------------


def test_index_matches_longest_prefix_per_node() -> None:
    idx = PrefixIndex(max_blocks=1000)
    a = _text(LONG + "question one")
    idx.insert("p0", a)
    b = _text(LONG + "another question")
    assert idx.match("p0", b) == len(LONG) // CHAR_BLOCK
    assert idx.match("p1", b) == 0
    assert idx.match("p0", a) == len(a.hashes)
    assert idx.match("p0", _text("something else entirely " * 10)) == 0
    idx.drop("p0")
    assert idx.match("p0", a) == 0 and idx.size("p0") == 0


def test_index_memory_is_bounded_and_evicts_prompt_ends_first() -> None:
    cap = 50
    idx = PrefixIndex(max_blocks=cap)
    hot = _text("H" * CHAR_BLOCK * 10)  # 10 blocks, used again and again
    for i in range(400):
        idx.insert("n", _text(f"{i:08d}" * (CHAR_BLOCK // 8) * 8))  # 8 fresh blocks
        assert idx.size("n") <= cap
        if i % 3 == 0:
            idx.insert("n", hot)
    assert idx.size("n") == cap and idx.evicted_total > 0
    # The hot prompt is recent enough to be whole; a prompt's surviving part is always a
    # prefix (eviction trims ends, never leaves a hole).
    assert idx.match("n", hot) == 10
    for i in range(390, 400):
        key = _text(f"{i:08d}" * (CHAR_BLOCK // 8) * 8)
        held = [h in idx._nodes["n"] for h in key.hashes]
        assert held == sorted(held, reverse=True), held
    # A prompt longer than the cap keeps its first blocks.
    huge = _text("".join(f"{i:07d}," for i in range(cap * CHAR_BLOCK)))
    idx.insert("m", huge)
    assert idx.size("m") == cap and idx.match("m", huge) == cap


def test_index_memory_per_block_is_small() -> None:
    """What --prefix-max-chars costs: measured bytes per remembered block."""
    idx = PrefixIndex(max_blocks=20_000)
    keys = [_text(f"{i:06d}" * 11 * 20) for i in range(1000)]  # 20 blocks each
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for k in keys:
        idx.insert("n", k)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_block = used / idx.size("n")
    assert idx.size("n") == 20_000
    assert per_block < 200, per_block  # default cap: 65,536 blocks per node, ~ a few MB


def test_estimator_learns_characters_per_token() -> None:
    est = TokenEstimator(4.0)
    k = _text("x" * 400)
    assert est.tokens(k) == 100
    est.observe(k, 400)  # the first answer replaces the prior
    assert est.ratio["text"] == pytest.approx(1.0) and est.tokens(k) == pytest.approx(400)
    est.observe(k, 200)  # later ones move the average
    assert 1.0 < est.ratio["text"] < 2.0
    est.observe(k, None)
    est.observe(k, 0)
    assert est.observed["text"] == 2 and est.ratio["chat"] == 4.0
    ids = PromptKey.of("ids", list(range(33)))
    assert est.tokens(ids) == 33 and est.tokens(ids, 16) == 16


# -- policies ----------------------------------------------------------------------------------


def test_cache_aware_follows_prefixes_spreads_new_ones_and_yields_to_load() -> None:
    pool = _pool(2, 1)
    idx = PrefixIndex(10_000)
    policy = CacheAware(
        idx, cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5
    )
    router = Router(pool, policy, index=idx, estimator=TokenEstimator(4.0))
    a1, a2 = _text("A" * 1000 + " q1"), _text("A" * 1000 + " another")
    b1, b2 = _text("B" * 1000 + " q1"), _text("B" * 1000 + " another")
    first = router.plan(a1).prefill
    assert first is not None
    assert router.plan(b1).prefill is not first and policy.last_reason == "spread"
    assert router.plan(a2).prefill is first and policy.last_reason == "prefix"
    assert router.plan(b2).prefill is not first and policy.last_reason == "prefix"
    # A small shared part (below --cache-threshold) does not bind: the smaller index wins.
    idx.insert(first.url, _text("C" * 5000))
    c = _text("A" * 200 + "D" * 2000)
    assert router.plan(c).prefill is not first and policy.last_reason == "spread"
    other = next(n for n in pool.prefill if n is not first)
    other.outstanding = 4  # busier, but within the absolute threshold: cache affinity
    assert router.plan(b2).prefill is other and policy.last_reason == "prefix"
    # Imbalanced (max - min > 4 and max > 1.5 x min): the least loaded node wins.
    other.outstanding = 10
    assert router.plan(b2).prefill is first and policy.last_reason == "load"
    assert router.decisions[("prefill", "prefix")] >= 3
    assert router.decisions[("prefill", "load")] == 1


def test_round_robin_ignores_load() -> None:
    pool = _pool(3, 1)
    router = Router(pool, RoundRobin())
    pool.prefill[0].outstanding = 100
    assert [router.pick("prefill").url for _ in range(3)] == [n.url for n in pool.prefill]


def test_nodes_that_leave_or_restart_lose_their_prefixes() -> None:
    pool = _pool(2, 1)
    router = Router.from_config(pool, _cfg("--routing", "prefix"))
    assert isinstance(router.policy, CacheAware) and router.index is not None
    for n in pool.all():
        router.index.insert(n.url, _text(LONG))
    p0, p1 = pool.prefill
    p0.mark_failed("boom")
    assert router.index.size(p0.url) == 0 and router.index.size(p1.url) > 0
    p1.update_info({"incarnation": "a", "side_channel": "tcp://x:1"}, None)
    assert router.index.size(p1.url) > 0  # first incarnation seen: nothing to forget
    p1.update_info({"incarnation": "b", "side_channel": "tcp://x:1"}, None)
    assert router.index.size(p1.url) == 0  # restarted
    assert router.index.size(pool.decode[0].url) > 0


# -- conditional disaggregation ----------------------------------------------------------------


def test_short_prompts_and_prompts_the_decode_node_holds_skip_the_prefill_node() -> None:
    pool = _pool(1, 2)
    router = Router.from_config(pool, _cfg("--disagg-min-prompt-tokens", "64"))
    assert isinstance(router.policy, LeastOutstanding) and router.index is not None
    short = router.plan(_text("Hello there"))
    assert short.decode_only and short.prompt_tokens == pytest.approx(11 / 4)
    long_key = _text(LONG)
    first = router.plan(long_key)
    assert first.prefill is pool.prefill[0] and first.decode_cached_tokens == 0
    router.estimator.observe(long_key, len(LONG))  # type: ignore[union-attr]  # 1 char/token
    # The same decode node (least load ties rotate, so pin it) holds LONG now: a short
    # continuation is prefilled there; on the other decode node it is not.
    d = first.decode
    other = next(n for n in pool.decode if n is not d)
    longer = _text(LONG + "and a short follow-up")
    other.outstanding = 1
    cont = router.plan(longer)
    assert cont.decode is d and cont.decode_only
    assert cont.decode_cached_tokens == pytest.approx(len(LONG) // CHAR_BLOCK * CHAR_BLOCK)
    other.outstanding, d.outstanding = 0, 1
    assert router.plan(longer).prefill is not None
    # A retry after P's first token was streamed always gets a prefill node.
    assert router.plan(_text("Hi"), allow_decode_only=False).prefill is not None
    # What the decode node answered extends what it holds (next turn of the conversation).
    d.outstanding = other.outstanding = 0
    router.answered(cont, longer, "x" * 300)
    assert router.index.match(d.url, _text(LONG + "and a short follow-up" + "x" * 300)) == (
        len(LONG + "and a short follow-up" + "x" * 300) // CHAR_BLOCK
    )
    assert router.modes["decode_only"] == 2 and router.modes["disaggregated"] == 3
    # Without a healthy prefill node short prompts are still served; long ones are not.
    pool.prefill[0].set_healthy(False, "down")
    assert router.plan(_text("Hello")).decode_only
    with pytest.raises(NoHealthyNode):
        router.plan(_text("a much longer prompt " * 20))


def test_disabled_by_default() -> None:
    cfg = _cfg()
    assert (cfg.routing, cfg.disagg_min_prompt_tokens) == ("least_load", 0)
    router = Router.from_config(_pool(1, 1), cfg)
    assert router.index is None and router.plan(_text("Hi")).prefill is not None


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--routing", "random"], None),  # argparse refuses it (exit 2)
        (["--cache-threshold", "1.5"], "--cache-threshold"),
        (["--balance-rel-threshold", "0.5"], "--balance-rel-threshold"),
        (["--prefix-max-chars", "10"], "--prefix-max-chars"),
        (["--disagg-min-prompt-tokens", "-1"], "--disagg-min-prompt-tokens"),
        (["--chars-per-token", "0"], "--chars-per-token"),
    ],
)
def test_bad_routing_flags_name_the_flag(argv: list[str], flag: str | None) -> None:
    if flag is None:
        with pytest.raises(SystemExit):
            _cfg(*argv)
        with pytest.raises(ProxyConfigError, match="--routing"):
            config_from_sources(argparse.Namespace(), {"PDPROXY_PREFILL": P, "PDPROXY_DECODE": D, "PDPROXY_ROUTING": "random"})  # fmt: skip
        return
    with pytest.raises(ProxyConfigError, match=flag):
        _cfg(*argv)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_without_generation_goes_to_the_decode_node_alone(stream: bool) -> None:
    """``echo`` with ``max_tokens`` 0 (lm-evaluation-harness's loglikelihood request)
    generates nothing: D alone serves it, a plain request (a transfer id, no KV), and P is
    never called. Stand-in nodes."""
    import asyncio

    from proxy.legs import Legs
    from proxy.metrics import ProxyMetrics
    from proxy.node_client import NodeClient
    from proxy.session import Session
    from proxy.validation import COMPLETIONS, validate_request
    from tests.standin_http import SeenRequest, StandIn, answer, chunked

    seen: list[tuple[str, SeenRequest]] = []
    choice = {"index": 0, "text": LONG, "logprobs": None, "finish_reason": "length",
              "stop_reason": None, "token_ids": []}  # fmt: skip
    usage = {"prompt_tokens": 400, "completion_tokens": 0, "total_tokens": 400}
    whole = {"id": "x", "object": "text_completion", "created": 1, "model": "tiny",
             "choices": [choice], "usage": usage}  # fmt: skip

    def node(role: str) -> Any:
        async def handle(req: SeenRequest) -> bytes:
            seen.append((role, req))
            if req.path == "/v1/abort":
                return answer(200, {})
            if not req.json().get("stream"):
                return answer(200, whole)
            events = [{**whole, "object": "text_completion.chunk", "usage": None}, "[DONE]"]
            pieces = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
                      for e in events]  # fmt: skip
            return chunked(200, pieces, {"Content-Type": "text/event-stream"})

        return handle

    async def main() -> tuple[Router, str, Any]:
        async with StandIn(node("prefill")) as p, StandIn(node("decode")) as d:
            cfg = _cfg("--routing", "prefix")
            cfg = ProxyConfig(**{**cfg.__dict__, "prefill": (p.url,), "decode": (d.url,)})
            pool = NodePool(cfg.prefill, cfg.decode)
            for n in pool.all():
                n.set_healthy(True)
                n.update_info({"side_channel": "tcp://10.0.0.1:5600"}, {"data": [{"id": "tiny"}]})
            router = Router.from_config(pool, cfg)
            body = {"prompt": LONG, "echo": True, "max_tokens": 0, "logprobs": 1, "stream": stream}
            req = validate_request(COMPLETIONS, json.dumps(body).encode(), ["tiny"], None)
            async with NodeClient(timeout=10) as client:
                legs = Legs(client)
                session = Session(req, "r", cfg, router, legs, ProxyMetrics(pool))
                try:
                    if stream:
                        await session.start_stream()
                        text = "".join([c async for c in session.events()])
                    else:
                        text = json.dumps(await session.complete())
                finally:
                    session.close()
                    await legs.drain()
            return router, d.url, (req.key, text)

    router, d_url, (key, text) = asyncio.run(main())
    assert LONG in text and "error" not in text
    assert [role for role, _ in seen] == ["decode"]
    kv = seen[0][1].json()["kv_transfer_params"]
    assert set(kv) == {"transfer_id"}, kv  # a plain request: D prefills it
    assert router.modes == {"decode_only": 1}
    # The answer's text is the echoed prompt, not text D caches after the prompt: the
    # index learns the prompt, not the prompt twice.
    assert router.index is not None
    assert router.index.match(d_url, key) == len(key.hashes)
    twice = key.extend(LONG)
    assert router.index.match(d_url, twice) == len(key.hashes) < len(twice.hashes)
