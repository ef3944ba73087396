"""OpenAI's ``prompt_cache_key`` steering ``--routing prefix`` (no processes: the router
over a pool of stand-in nodes): requests with the same key go to the same prefill and
decode node whatever their text, while that node is ready and the load balanced; keys
spread; a key whose node leaves moves and stays where it moved; the memory of keys is
bounded. Entry checks (a 400 naming the field): ``tests/test_prompt_cache_key.py``."""

from __future__ import annotations

import argparse
from typing import Any

from engine.server.chat_protocol import parse_chat_request
from engine.server.protocol import parse_completion_request
from proxy.config import ProxyConfig, add_proxy_args, config_from_sources
from proxy.metrics import ProxyMetrics
from proxy.nodes import Node, NodePool
from proxy.prefix import PromptKey, prompt_key
from proxy.router import Router

P, D = "http://10.0.0.1:8100", "http://10.0.0.2:8200"


def _cfg(*argv: str) -> ProxyConfig:
    parser = argparse.ArgumentParser()
    add_proxy_args(parser)
    argv = ("--prefill", P, "--decode", D, "--routing", "prefix", *argv)
    return config_from_sources(parser.parse_args(argv), {})


def _router(n_p: int, n_d: int, *argv: str) -> Router:
    pool = NodePool(
        tuple(f"http://p{i}:1" for i in range(n_p)), tuple(f"http://d{i}:1" for i in range(n_d))
    )
    for n in pool.all():
        n.model, n.side_channel = "tiny", "tcp://x:1"
        n.set_healthy(True)
    return Router.from_config(pool, _cfg(*argv))


def _key(text: str, cache_key: str | None, salt: str | None = None) -> PromptKey:
    body: dict[str, Any] = {"prompt": text, "prompt_cache_key": cache_key}
    if salt is not None:
        body["cache_salt"] = salt
    return prompt_key(parse_completion_request(body))


def _text(i: int) -> str:
    """A prompt of its own: no block in common with another ``i``'s."""
    return f"{i:04d} " * 60


def _route(router: Router, key: PromptKey) -> tuple[Node, Node]:
    """Plan a route and end it served (the nodes now hold the prompt)."""
    route = router.plan(key)
    assert route.prefill is not None
    router.finish(route, True, True)
    return route.prefill, route.decode


def _urls(router: Router, key: PromptKey) -> tuple[str, str]:
    p, d = _route(router, key)
    return p.url, d.url


def test_the_same_key_goes_to_the_same_nodes_whatever_the_prompt() -> None:
    router = _router(3, 2)
    routes = {_urls(router, _key(_text(i), "conversation-1")) for i in range(20)}
    assert len(routes) == 1, routes
    assert router.decisions[("prefill", "cache_key")] == 19
    assert router.decisions[("decode", "cache_key")] == 19
    # A chat request's key steers the same way (its own prompt text, the same key).
    chat = parse_chat_request(
        {"messages": [{"role": "user", "content": _text(99)}], "prompt_cache_key": "conversation-1"}
    )
    assert _urls(router, prompt_key(chat)) in routes
    # The metric shows the key's decisions apart from the prefix's.
    text = ProxyMetrics(router.pool, router=router).render().decode()
    assert 'route_decisions_total{reason="cache_key",role="prefill"} 20.0' in text, text


def test_different_keys_spread_and_each_sticks() -> None:
    router = _router(4, 2)
    firsts = {k: _route(router, _key(_text(k), f"user-{k}"))[0] for k in range(8)}
    assert {n.url for n in firsts.values()} == {n.url for n in router.pool.prefill}
    for k in range(8):
        for j in range(3):
            assert _route(router, _key(_text(100 + 10 * k + j), f"user-{k}"))[0] is firsts[k]


def test_the_key_wins_over_another_nodes_text_prefix() -> None:
    router = _router(2, 1)
    owner = _route(router, _key(_text(1), "k"))[0]
    other = next(n for n in router.pool.prefill if n is not owner)
    assert router.index is not None
    router.index.insert(other.url, _key(_text(2), None))  # the other node holds the text
    assert _route(router, _key(_text(2), "k"))[0] is owner
    assert _route(router, _key(_text(2), None))[0] is other  # without the key: the prefix


def test_a_key_whose_node_leaves_moves_and_stays_moved() -> None:
    router = _router(3, 1)
    owner = _route(router, _key(_text(1), "k"))[0]
    owner.mark_failed("boom")  # out of rotation (a failure, or a health check)
    moved = _route(router, _key(_text(2), "k"))[0]
    assert moved is not owner
    owner.set_healthy(True)  # back: the key does not flap back
    assert {_urls(router, _key(_text(3 + i), "k"))[0] for i in range(5)} == {moved.url}
    router.pool.remove(moved, "deregistered")  # membership churn
    again = _route(router, _key(_text(10), "k"))[0]
    assert again is not moved and _route(router, _key(_text(11), "k"))[0] is again


def test_an_overloaded_owner_yields_as_prefix_affinity_does_and_keeps_the_key() -> None:
    router = _router(2, 1, "--balance-abs-threshold", "4")
    owner = _route(router, _key(_text(1), "k"))[0]
    owner.outstanding = 4  # busier, within what prefix affinity tolerates
    assert _route(router, _key(_text(2), "k"))[0] is owner
    owner.outstanding = 10  # imbalanced: the least loaded node, this once
    assert _route(router, _key(_text(3), "k"))[0] is not owner
    owner.outstanding = 0
    assert _route(router, _key(_text(4), "k"))[0] is owner


def test_a_retry_avoiding_the_owner_does_not_move_the_key() -> None:
    router = _router(2, 1)
    owner = _route(router, _key(_text(1), "k"))[0]
    route = router.plan(_key(_text(2), "k"), exclude={owner.url})
    assert route.prefill is not owner
    router.finish(route, True, True)
    assert _route(router, _key(_text(3), "k"))[0] is owner


def test_keys_are_per_tenant_and_their_memory_is_bounded() -> None:
    assert _key("x", "k", salt="a").affinity != _key("x", "k", salt="b").affinity
    assert _key("x", "k").affinity != _key("x", "k", salt="a").affinity
    assert _key("x", None).affinity is None and _key("x", "").affinity is None
    # --prefix-max-chars bounds the keys remembered per role, as it bounds the index.
    router = _router(2, 1, "--prefix-max-chars", str(64 * 16))
    owners = router.policy.owners  # type: ignore[attr-defined]
    for k in range(50):
        _route(router, _key(_text(k), f"user-{k}"))
    assert owners.size("prefill") == 16 and owners.size("decode") == 16
    assert owners.owner("prefill", _key("x", "user-49").affinity) is not None
    assert owners.owner("prefill", _key("x", "user-0").affinity) is None


def test_served_same_key_requests_with_other_texts_reach_one_prefill_node() -> None:
    """Through a proxy ``Session`` against stand-in nodes (two prefill, one decode): six
    requests with one key and six texts all reach one prefill node, and each node gets
    the key in its body (a node accepts it)."""
    import asyncio
    import json

    from proxy.legs import Legs
    from proxy.node_client import NodeClient
    from proxy.session import Session
    from proxy.validation import COMPLETIONS, validate_request
    from tests.standin_http import SeenRequest, StandIn, answer
    from tests.test_proxy_node_config import D_ANSWER
    from tests.test_proxy_waits import PREFILL_ANSWER, _node, _ready_pool

    seen: dict[str, list[Any]] = {}

    def leg(name: str, body: dict[str, Any]) -> Any:
        async def handle(req: SeenRequest) -> bytes:
            seen.setdefault(name, []).append(req.json().get("prompt_cache_key"))
            return answer(200, {**body, "model": "tiny"})

        return _node(handle)

    async def main() -> None:
        async with (
            StandIn(leg("p0", PREFILL_ANSWER)) as p0,
            StandIn(leg("p1", PREFILL_ANSWER)) as p1,
            StandIn(leg("d", D_ANSWER)) as d,
        ):
            cfg = ProxyConfig(prefill=(p0.url, p1.url), decode=(d.url,), routing="prefix")
            pool = _ready_pool(cfg)
            router = Router.from_config(pool, cfg)
            async with NodeClient(timeout=20) as client:
                legs = Legs(client)
                for i in range(6):
                    raw = json.dumps(
                        {"prompt": _text(i), "max_tokens": 3, "prompt_cache_key": "chat-42"}
                    ).encode()
                    req = validate_request(COMPLETIONS, raw, ["tiny"], None)
                    session = Session(req, f"r{i}", cfg, router, legs, ProxyMetrics(pool))
                    try:
                        body = await asyncio.wait_for(session.complete(), 15)
                    finally:
                        session.close()
                    assert body["choices"][0]["token_ids"] == [7, 8, 9], body
                await legs.drain()

    asyncio.run(main())
    prefills = {k: v for k, v in seen.items() if k != "d"}
    assert len(prefills) == 1 and sum(map(len, prefills.values())) == 6, seen
    assert all(k == "chat-42" for v in seen.values() for k in v), seen
