"""Prefix-aware routing and conditional disaggregation end to end: 2 prefill nodes, 1
decode node and a colocated reference node (tiny model: one byte is one token, so prompt
lengths are token counts), proxies started per test with their own prefix index.

Everything is asserted through the nodes' own counters (requests received, prompt tokens
computed, KV blocks pushed) and the answers' token ids against the colocated node; no
timings.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from harness import (
    GREEDY,
    PD,
    Proc,
    Procs,
    node_generate_requests,
    sse_events,
    stream_ids,
)

pytestmark = pytest.mark.slow

BLOCK = 16  # the nodes' --block-size (default)


def _prefix(tag: str, n: int = 600) -> str:
    """``n`` characters that no other test's prompts start with."""
    words = f"{tag} says: the quick brown fox jumps over the lazy dog near river bank. "
    return (words * (n // len(words) + 1))[:n]


class Setup:
    def __init__(self, procs: Procs) -> None:
        self.procs = procs
        self.pd: PD = procs.pd(2, 1, "--num-blocks", "512", colocated=True)
        self.colo: Proc = self.pd.colocated  # type: ignore[assignment]

    def proxy(self, *args: str) -> Proc:
        return self.procs.proxy(
            [p.url for p in self.pd.prefill], [d.url for d in self.pd.decode], *args
        )


@pytest.fixture(scope="module")
def setup(module_procs: Procs) -> Setup:
    return Setup(module_procs)


def _counts(nodes: list[Proc]) -> dict[str, tuple[float, float]]:
    """Per node: (generation requests received, prompt tokens computed)."""
    return {
        n.url: (node_generate_requests(n.url), n.metric("pdserve_prompt_tokens_total"))
        for n in nodes
    }


def _delta(
    before: dict[str, tuple[float, float]], nodes: list[Proc]
) -> dict[str, tuple[float, float]]:
    after = _counts(nodes)
    return {u: (after[u][0] - before[u][0], after[u][1] - before[u][1]) for u in before}


def _complete(url: str, prompt: str, stream: bool = False, **kw: Any) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 8, "stream": stream, **GREEDY, **kw}
    if not stream:
        resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return list(resp.json()["choices"][0]["token_ids"])
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        events = sse_events(resp)
    assert events[-1] == "DONE" and not any("error" in e for e in events if isinstance(e, dict))
    return stream_ids(events)


def _chat(url: str, content: str, stream: bool) -> tuple[str, list[int]]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "stream": stream,
            **GREEDY}  # fmt: skip
    if not stream:
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        c = resp.json()["choices"][0]
        return c["message"]["content"], list(c["token_ids"])
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        events = sse_events(resp)
    text = "".join(
        c.get("delta", {}).get("content") or ""
        for e in events if isinstance(e, dict) for c in e.get("choices", [])
    )  # fmt: skip
    return text, stream_ids(events)


def _one_got_it(delta: dict[str, tuple[float, float]]) -> str:
    """The one prefill node that received exactly one request (the others none)."""
    got = [u for u, (reqs, _) in delta.items() if reqs]
    assert len(got) == 1 and delta[got[0]][0] == 1, delta
    return got[0]


def test_shared_prefix_goes_to_the_prefill_node_holding_it(setup: Setup) -> None:
    proxy = setup.proxy("--routing", "prefix")
    pre = _prefix("alpha")
    prompts = [pre + " Question one?", pre + " And a second, longer question?"]
    before = _counts(setup.pd.prefill)
    ids = [_complete(proxy.url, prompts[0])]
    first = _delta(before, setup.pd.prefill)
    holder = _one_got_it(first)
    assert first[holder][1] == len(prompts[0])  # a cold cache: every prompt token computed
    before = _counts(setup.pd.prefill)
    ids.append(_complete(proxy.url, prompts[1], stream=True))
    second = _delta(before, setup.pd.prefill)
    assert _one_got_it(second) == holder
    # The shared prefix came from the node's prefix cache: only its last partial block
    # and the new question were computed.
    assert second[holder][1] <= len(prompts[1]) - (len(pre) // BLOCK) * BLOCK, second
    assert second[holder][1] < len(prompts[1]) // 4
    assert ids == [_complete(setup.colo.url, p) for p in prompts]  # never changes tokens
    assert proxy.metric("pdproxy_route_decisions_total", {"role": "prefill", "reason": "prefix"}) >= 1  # fmt: skip
    assert proxy.metric("pdproxy_prefix_index_blocks", {"url": holder}) >= len(pre) // 64


def test_different_prefixes_spread_over_prefill_nodes(setup: Setup) -> None:
    proxy = setup.proxy("--routing", "prefix")  # a fresh index
    where: dict[str, set[str]] = {"gamma": set(), "delta": set()}
    for rnd in range(2):
        for tag in where:
            before = _counts(setup.pd.prefill)
            _complete(proxy.url, _prefix(tag) + f" round {rnd}")
            where[tag].add(_one_got_it(_delta(before, setup.pd.prefill)))
    assert len(where["gamma"]) == 1 and len(where["delta"]) == 1, where  # each sticks...
    assert where["gamma"] != where["delta"]  # ... to its own node
    assert proxy.metric("pdproxy_route_decisions_total", {"role": "prefill", "reason": "spread"}) >= 2  # fmt: skip


def test_short_prompts_never_reach_a_prefill_node(setup: Setup) -> None:
    proxy = setup.proxy("--disagg-min-prompt-tokens", "64")
    d = setup.pd.d
    before, d_before = _counts(setup.pd.prefill), node_generate_requests(d.url)
    prompts = ["Hello there", "The quick brown fox", "1 2 3 4 5 6 7 8"]
    got = [_complete(proxy.url, prompts[0]), _complete(proxy.url, prompts[1], stream=True)]
    got.append(_complete(proxy.url, prompts[2], stream=True, stop=["zzz"]))
    chat = [_chat(proxy.url, "Hi!", stream=False), _chat(proxy.url, "Hi!", stream=True)]
    assert all(reqs == 0 for reqs, _ in _delta(before, setup.pd.prefill).values())
    assert node_generate_requests(d.url) - d_before == 5
    assert got == [_complete(setup.colo.url, p) for p in prompts]
    ref = _chat(setup.colo.url, "Hi!", stream=False)
    assert chat == [ref, ref] and ref[1]
    assert proxy.metric("pdproxy_route_mode_total", {"mode": "decode_only"}) == 5
    # A long prompt is still disaggregated.
    before = _counts(setup.pd.prefill)
    long_prompt = _prefix("epsilon", 400)
    assert _complete(proxy.url, long_prompt) == _complete(setup.colo.url, long_prompt)
    _one_got_it(_delta(before, setup.pd.prefill))
    assert proxy.metric("pdproxy_route_mode_total", {"mode": "disaggregated"}) == 1


def test_decode_node_holding_the_prefix_prefills_the_rest_itself(setup: Setup) -> None:
    proxy = setup.proxy("--disagg-min-prompt-tokens", "64")
    d = setup.pd.d
    pre = _prefix("zeta")
    before = _counts([*setup.pd.prefill, d])
    first = _complete(proxy.url, pre)  # P/D: D receives (and caches) the prompt's KV
    delta = _delta(before, [*setup.pd.prefill, d])
    _one_got_it({u: v for u, v in delta.items() if u != d.url})
    assert delta[d.url] == (1, 0)  # D computed no prompt token: the KV was pushed
    # The proxy learned ~1 character per token from P's usage.
    assert proxy.metric("pdproxy_chars_per_token", {"kind": "text"}) == pytest.approx(1.0)
    follow = pre + " and then?"
    before = _counts([*setup.pd.prefill, d])
    second = _complete(proxy.url, follow, stream=True)
    delta = _delta(before, [*setup.pd.prefill, d])
    assert all(delta[p.url][0] == 0 for p in setup.pd.prefill), delta
    reqs, computed = delta[d.url]
    assert reqs == 1 and 0 < computed <= len(follow) - (len(pre) // BLOCK) * BLOCK, delta
    assert [first, second] == [_complete(setup.colo.url, p) for p in (pre, follow)]


def test_decode_prefix_hit_shrinks_the_push(setup: Setup) -> None:
    proxy = setup.proxy("--routing", "prefix")
    pre = _prefix("eta")
    sent = "pdserve_engine_kv_blocks_sent_total"
    prompts = [pre + " one", pre + " two, three"]
    got = []
    pushed = []
    for prompt in prompts:
        before = {p.url: p.metric(sent) for p in setup.pd.prefill}
        got.append(_complete(proxy.url, prompt))
        pushed.append(sum(p.metric(sent) - before[p.url] for p in setup.pd.prefill))
    # The first push carries every block of the prompt; the second only the blocks D's own
    # prefix cache lacks (the connector reserves no more).
    assert pushed[0] >= len(prompts[0]) // BLOCK
    assert 0 < pushed[1] <= 2, pushed
    assert got == [_complete(setup.colo.url, p) for p in prompts]


def test_prefix_index_memory_is_bounded(setup: Setup) -> None:
    proxy = setup.proxy("--routing", "prefix", "--prefix-max-chars", "1024")  # 16 blocks
    for i in range(6):
        _complete(proxy.url, _prefix(f"theta{i}", 300), max_tokens=1)
    for n in setup.pd.nodes:
        assert proxy.metric("pdproxy_prefix_index_blocks", {"url": n.url}) <= 16
    assert proxy.metric("pdproxy_prefix_index_evicted_blocks_total") > 0
