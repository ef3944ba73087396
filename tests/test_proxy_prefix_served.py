"""The prefix index claims a prompt for a node once the node served it, through a
``Session`` against stand-in nodes: a prompt counts as on its way to the nodes it was
routed to while its request runs (requests sharing a prefix follow it), and stays only
for the nodes that served it.

Found by a review of prefix routing: a prompt was recorded under the nodes it was routed
to before either served it, so a refused pair, a request a node refused, or a client that
left all left a claim for a prefix the node lacked (and drew that prefix's next requests
to it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.config import ProxyConfig
from proxy.nodes import NodePool
from proxy.prefix import PrefixIndex, PromptKey
from proxy.router import Router
from tests.standin_http import SeenRequest, StandIn, answer
from tests.test_proxy_node_config import D_ANSWER, RefusingDecode, _request
from tests.test_proxy_waits import PREFILL_ANSWER, _node, _ready_pool

LONG = "".join(f"word{i} " for i in range(200))


async def _serve(cfg: ProxyConfig, pool: NodePool, router: Router, stream: bool) -> Any:
    return await _request(cfg, pool, router, stream, LONG)


def _prefix_router(pool: NodePool) -> Router:
    return Router(pool, index=PrefixIndex(1 << 16))


KEY = PromptKey.of("text", LONG)
BLOCKS = len(KEY.hashes)


def test_a_prefill_node_the_decode_node_refused_is_not_said_to_hold_the_prompt() -> None:
    """D refuses P's side channel, then serves the request alone: D holds the prompt, P
    never computed it (its leg was aborted while it waited for a reservation)."""

    async def prefill(req: SeenRequest) -> bytes:
        await asyncio.sleep(5)
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def main() -> None:
        async with StandIn(_node(prefill)) as p, StandIn(_node(RefusingDecode())) as d:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,), health_interval=0.1)
            pool = _ready_pool(cfg)
            router = _prefix_router(pool)
            body = await _serve(cfg, pool, router, stream=False)
            assert body["choices"][0]["token_ids"] == [7, 8, 9], body
            assert router.index is not None
            assert router.index.match(d.url, KEY) == BLOCKS  # D served it
            assert router.index.match(p.url, KEY) == 0  # P did not

    asyncio.run(main())


def test_a_request_a_node_refused_is_not_said_to_be_held_there() -> None:
    """D refuses the request itself (a 400: e.g. the prompt is longer than its context):
    the client gets the 400, and no node is said to hold the prompt but the prefill node
    that answered its leg."""

    async def prefill(req: SeenRequest) -> bytes:
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def decode(req: SeenRequest) -> bytes:
        error = {"message": "prompt too long", "type": "invalid_request_error", "param": "prompt"}
        return answer(400, {"error": error})

    async def main() -> None:
        async with StandIn(_node(prefill)) as p, StandIn(_node(decode)) as d:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,), health_interval=0.1)
            pool = _ready_pool(cfg)
            router = _prefix_router(pool)
            try:
                await _serve(cfg, pool, router, stream=False)
            except Exception as e:  # noqa: BLE001 - the PassThrough the client gets
                assert "prompt too long" in str(e), e
            else:
                raise AssertionError("the decode node's 400 was not passed on")
            assert router.index is not None
            assert router.index.match(d.url, KEY) == 0
            assert router.index.size(d.url) == 0

    asyncio.run(main())


def test_a_pair_that_served_the_prompt_holds_it_and_concurrent_routes_see_it_meanwhile() -> None:
    """Both nodes of a pair that served a request hold its prompt (and D its answer);
    while the request runs, its prompt already draws the same prefix to the same nodes
    (counted as on its way), and a route that ends unserved leaves nothing."""

    async def prefill(req: SeenRequest) -> bytes:
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def decode(req: SeenRequest) -> bytes:
        return answer(200, D_ANSWER)

    async def main() -> None:
        async with StandIn(_node(prefill)) as p, StandIn(_node(decode)) as d:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,), health_interval=0.1)
            pool = _ready_pool(cfg)
            router = _prefix_router(pool)
            assert router.index is not None
            await _serve(cfg, pool, router, stream=False)
            assert router.index.match(d.url, KEY) == BLOCKS
            assert router.index.match(p.url, KEY) == BLOCKS
            other = PromptKey.of("text", "other " * 100)
            route = router.plan(other)  # on its way: matched, not yet held
            assert router.index.match(d.url, other) == len(other.hashes)
            router.finish(route, prefill_served=False, decode_served=False)
            assert router.index.match(d.url, other) == 0
            assert router.index.match(p.url, other) == 0

    asyncio.run(main())
