"""Nodes configured so that they cannot work together, behind the proxy: a node listed in
the other role, and a decode node whose ``--kv-allowed-peers`` does not cover a prefill
node's side channel (a node bound to ``0.0.0.0`` advertises its non-loopback address). The
client never gets a 400 about parameters the proxy built: the misfit node is out of
rotation with a reason naming the mix-up, or the pair is not routed to and the decode node
prefills by itself. Found by a new-user walkthrough (every request was a 400 blaming the
client, and ``/health`` said ok)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from harness import GREEDY as HTTP_GREEDY
from harness import NIXL, Procs, assert_completes_with, metric, sse_chunk_events
from hf_models import random_prompt

from proxy.config import ProxyConfig
from proxy.health import HealthChecker
from proxy.legs import Legs
from proxy.metrics import ProxyMetrics
from proxy.node_client import NodeClient
from proxy.nodes import NodePool
from proxy.router import Router
from proxy.session import Session
from proxy.validation import validate_request
from tests.standin_http import SeenRequest, StandIn, answer, chunked
from tests.test_proxy_waits import PREFILL_ANSWER, _node, _ready_pool, _sse, _token

COMPLETIONS = "/v1/completions"
D_ANSWER = {
    "choices": [{"index": 0, "text": "xyz", "finish_reason": "length", "token_ids": [7, 8, 9]}],
    "model": "tiny",
}


def _facts(kv_role: str) -> Any:
    async def handler(req: SeenRequest) -> bytes:
        if req.path == "/v1/kv_transfer_info":
            info = {"side_channel": "tcp://127.0.0.1:1", "incarnation": "i1", "role": kv_role}
            return answer(200, info)
        if req.path == "/v1/models":
            return answer(200, {"data": [{"id": "tiny", "max_model_len": 64}]})
        return answer(200, {"status": "ok"})

    return handler


@pytest.mark.parametrize(
    ("listed", "kv_role", "fits"),
    [("prefill", "consumer", False), ("decode", "producer", False),
     ("prefill", "producer", True), ("decode", "consumer", True), ("prefill", "both", True)],
)  # fmt: skip
def test_a_node_listed_in_the_other_role_is_out_of_rotation_naming_the_mix_up(
    listed: str, kv_role: str, fits: bool
) -> None:
    async def main() -> None:
        async with StandIn(_facts(kv_role)) as n, NodeClient(timeout=5) as client:
            pool = NodePool((n.url,), ()) if listed == "prefill" else NodePool((), (n.url,))
            (node,) = pool.nodes(listed)  # type: ignore[arg-type]
            await HealthChecker(pool, client, interval=1.0).check_all()
            assert node.ready is fits, node.last_error
            if not fits:
                other = "decode" if listed == "prefill" else "prefill"
                assert f"it is a {other} node" in (node.last_error or "")
                assert f"--{other}" in (node.last_error or "")

    asyncio.run(main())


def test_a_prefill_node_without_a_kv_connector_is_out_of_rotation_saying_how_to_fix_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # `prefill-node` without --kv-connector nixl serves colocated and advertises no side
    # channel: the proxy never routes to it. Found by a new-user walkthrough: every request
    # was a 503 "no healthy prefill node", the proxy logged nothing, and /health said only
    # "prefill node advertises no KV side channel".
    async def colocated(req: SeenRequest) -> bytes:
        if req.path == "/v1/kv_transfer_info":
            return answer(200, {"reasoning_parser": None})
        if req.path == "/v1/models":
            return answer(200, {"data": [{"id": "tiny", "max_model_len": 64}]})
        return answer(200, {"status": "ok"})

    async def main() -> None:
        async with StandIn(colocated) as n, NodeClient(timeout=5) as client:
            pool = NodePool((n.url,), ())
            (node,) = pool.nodes("prefill")
            checker = HealthChecker(pool, client, interval=1.0)
            with caplog.at_level("WARNING", logger="proxy"):
                for _ in range(3):
                    await checker.check_all()
            assert not node.ready
            assert "--kv-connector nixl" in (node.last_error or "")
            warned = [r.getMessage() for r in caplog.records if n.url in r.getMessage()]
            assert len(warned) == 1 and "--kv-connector nixl" in warned[0], warned

    asyncio.run(main())


REFUSAL = {
    "error": {
        "message": "kv_transfer_params.remote_side_channel 'tcp://192.0.2.2:5600' is not an "
        "allowed prefill peer; start the decode node with --kv-allowed-peers naming it",
        "type": "invalid_request_error",
        "param": "kv_transfer_params.remote_side_channel",
        "code": None,
    }
}


class RefusingDecode:
    """A decode node that refuses any leg naming a prefill node's side channel and serves
    legs without one (it prefills by itself)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.legs: list[dict[str, Any]] = []
        self.delay = delay  # before a refusal

    async def __call__(self, req: SeenRequest) -> Any:
        body = req.json()
        kv = body.get("kv_transfer_params") or {}
        self.legs.append(kv)
        if kv.get("remote_side_channel"):
            await asyncio.sleep(self.delay)
            return answer(400, REFUSAL)
        if body.get("stream"):
            return chunked(200, _sse(_token(7), _token(8), _token(9, "length")))
        return answer(200, D_ANSWER)


async def _request(
    cfg: ProxyConfig, pool: NodePool, router: Router, stream: bool, prompt: str = "x"
) -> Any:
    """One completion of ``prompt`` through a proxy session: its body, or its events."""
    raw = json.dumps({"prompt": prompt, "max_tokens": 3, "stream": stream}).encode()
    req = validate_request(COMPLETIONS, raw, ["tiny"], None)
    async with NodeClient(timeout=20) as client:
        legs = Legs(client)
        session = Session(req, "r", cfg, router, legs, ProxyMetrics(pool))
        try:
            if not stream:
                return await asyncio.wait_for(session.complete(), 15)
            await asyncio.wait_for(session.start_stream(), 15)
            chunks = [c async for c in session.events()]
            return sse_chunk_events(chunks)
        finally:
            session.close()
            await legs.drain()


def test_a_decode_node_refusing_the_prefill_nodes_side_channel_prefills_by_itself() -> None:
    """D refuses P's side channel: the request is served by D alone (no 400 for the
    client, no retry counted, neither node failed), and the router does not pair them
    again: the next requests go straight to D alone (mode ``peer_refused``)."""
    seen_p: list[str] = []

    async def prefill(req: SeenRequest) -> bytes:
        seen_p.append(req.path)
        await asyncio.sleep(5)  # waits for a reservation that never comes (aborted)
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def main() -> None:
        d = RefusingDecode()
        async with StandIn(_node(prefill)) as p_stand, StandIn(_node(d)) as d_stand:
            cfg = ProxyConfig(prefill=(p_stand.url,), decode=(d_stand.url,), health_interval=0.1)
            pool = _ready_pool(cfg)
            router = Router(pool)
            body = await _request(cfg, pool, router, stream=False)
            assert body["choices"][0]["token_ids"] == [7, 8, 9], body
            events = await _request(cfg, pool, router, stream=True)
            assert not any("error" in e for e in events), events
            assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == [7, 8, 9]
            # The first request tried the pair once; then only D alone, no side channel.
            assert [bool(kv.get("remote_side_channel")) for kv in d.legs] == [
                True, False, False
            ]  # fmt: skip
            assert seen_p == ["/v1/completions"]
            assert router.modes["peer_refused"] == 2 and router.modes["disaggregated"] == 1
            assert all(n.healthy for n in pool.all())

    asyncio.run(main())


def test_a_decode_node_refusing_one_prefill_node_is_paired_with_another() -> None:
    """Two P's; D refuses P1's side channel only: the request goes to the pair with P2."""

    async def prefill(req: SeenRequest) -> bytes:
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    d_legs: list[dict[str, Any]] = []

    async def decode(req: SeenRequest) -> bytes:
        kv = req.json().get("kv_transfer_params") or {}
        d_legs.append(kv)
        if kv.get("remote_side_channel") == "tcp://192.0.2.2:1":
            return answer(400, REFUSAL)
        return answer(200, D_ANSWER)

    async def main() -> None:
        async with (
            StandIn(_node(prefill)) as p1, StandIn(_node(prefill)) as p2,
            StandIn(_node(decode)) as d,
        ):  # fmt: skip
            cfg = ProxyConfig(
                prefill=(p1.url, p2.url), decode=(d.url,), health_interval=0.1,
                routing="round_robin",
            )  # fmt: skip
            pool = _ready_pool(cfg)
            pool.nodes("prefill")[0].update_info({"side_channel": "tcp://192.0.2.2:1"}, None)
            router = Router(pool)
            for _ in range(3):
                body = await _request(cfg, pool, router, stream=False)
                assert body["choices"][0]["token_ids"] == [7, 8, 9], body
            sides = [kv.get("remote_side_channel") for kv in d_legs]
            assert sides[0] == "tcp://192.0.2.2:1"  # round robin tried P1 first, once
            assert sides[1:] == ["tcp://127.0.0.1:1"] * 3, sides
            assert router.modes["peer_refused"] == 0

    asyncio.run(main())


def test_a_decode_node_is_paired_only_with_prefill_nodes_of_its_reasoning_parser() -> None:
    """Two P's, one started with a ``--reasoning-parser`` D does not have: P's first token
    would come from a different answer (free reasoning against D's plain one), so the
    pair is never made -- every request goes to the P whose parser is D's."""

    async def prefill(req: SeenRequest) -> bytes:
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    d_legs: list[dict[str, Any]] = []

    async def decode(req: SeenRequest) -> bytes:
        d_legs.append(req.json().get("kv_transfer_params") or {})
        return answer(200, D_ANSWER)

    async def main() -> None:
        async with (
            StandIn(_node(prefill)) as p1, StandIn(_node(prefill)) as p2,
            StandIn(_node(decode)) as d,
        ):  # fmt: skip
            cfg = ProxyConfig(
                prefill=(p1.url, p2.url), decode=(d.url,), health_interval=0.1,
                routing="round_robin",
            )  # fmt: skip
            pool = _ready_pool(cfg)
            pool.nodes("prefill")[0].update_info(
                {"side_channel": "tcp://192.0.2.2:1", "reasoning_parser": "deepseek_r1"}, None
            )
            router = Router(pool)
            for _ in range(3):
                body = await _request(cfg, pool, router, stream=False)
                assert body["choices"][0]["token_ids"] == [7, 8, 9], body
            sides = [kv.get("remote_side_channel") for kv in d_legs]
            assert sides == ["tcp://127.0.0.1:1"] * 3, sides

    asyncio.run(main())


@pytest.mark.slow
def test_through_the_proxy_a_decode_node_that_refuses_the_prefill_node_answers_alone(
    procs: Procs,
) -> None:
    """Real nodes: D's --kv-allowed-peers (10.0.0.0/8) does not cover P's loopback side
    channel. Through the proxy, streamed and not, the answers are the colocated node's,
    D computed the prompts itself, P pushed nothing and stays in rotation."""
    common = ("--num-blocks", "128")
    p = procs.node(*NIXL, *common, module="prefill_node", name="p", wait=False)
    d = procs.node(*NIXL, *common, "--kv-allowed-peers", "10.0.0.0/8", module="decode_node",
                   name="d", wait=False)  # fmt: skip
    colocated = procs.node(*common, name="colocated")
    proxy = procs.proxy([p.url], [d.url])
    body = {"prompt": random_prompt(40, 256, seed=3), "max_tokens": 6, **HTTP_GREEDY}
    want = httpx.post(colocated.url + "/v1/completions", json=body, timeout=60).json()
    assert_completes_with(proxy.url, body, want["choices"][0]["token_ids"])
    assert metric(proxy.url, "pdproxy_route_mode_total", {"mode": "peer_refused"}) >= 1
    assert proxy.metric("pdproxy_node_failures_total", {"role": "prefill"}) == 0
    assert proxy.metric("pdproxy_node_failures_total", {"role": "decode"}) == 0
    assert p.metric("pdserve_engine_kv_transfers_started_total") == 0
    assert d.metric("pdserve_prompt_tokens_total") >= 40  # the prompt computed on D (then cached)


async def _stream(cfg: ProxyConfig, pool: NodePool, router: Router) -> tuple[list[int], list]:
    events = await _request(cfg, pool, router, stream=True)
    return [t for e in events for c in e.get("choices", []) for t in c["token_ids"]], events


async def _prefill(req: SeenRequest) -> bytes:
    choice = {**PREFILL_ANSWER["choices"][0], "text": "t7"}  # D's text of token 7, as a node
    return answer(200, {**PREFILL_ANSWER, "choices": [choice], "model": "tiny"})


async def _good_decode(req: SeenRequest) -> bytes:
    return chunked(200, _sse(_token(7), _token(8), _token(9, "length")))


def test_a_rerun_that_needs_a_pair_takes_a_decode_node_that_accepts_the_prefill_node() -> None:
    """P's first token was streamed, then D1's stream broke before its own tokens: the
    rerun must be a pair (to check that token). D3 is known to refuse P, D2 is not: the
    rerun takes P + D2 (the router picked D3 and gave up with an error event; found by a
    review)."""

    async def d1_broken(req: SeenRequest) -> Any:
        await asyncio.sleep(0.3)  # P's first token is streamed first
        return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", True

    async def main() -> tuple[list[int], list]:
        async with (
            StandIn(_node(_prefill)) as p, StandIn(_node(d1_broken)) as d1,
            StandIn(_node(_good_decode)) as d2, StandIn(_node(RefusingDecode())) as d3,
        ):  # fmt: skip
            cfg = ProxyConfig(
                prefill=(p.url,), decode=(d1.url, d2.url, d3.url), health_interval=0.1,
                routing="round_robin",
            )  # fmt: skip
            pool = _ready_pool(cfg)
            router = Router(pool)
            (pn,) = pool.nodes("prefill")
            router.refuse_pair(pn, pool.nodes("decode")[2], "learned from an earlier request")
            return await _stream(cfg, pool, router)

    ids, events = asyncio.run(main())
    assert ids == [7, 8, 9] and not any("error" in e for e in events), events


def test_a_decode_node_without_a_kv_connector_prefills_alone_and_stays_in_rotation() -> None:
    """D has no KV connector (its kv_transfer_info is empty: no role to check), so it
    refuses every P/D leg with a 400 naming kv_transfer_params: like a refused side
    channel, the pair is not routed to again and D serves alone; D stays healthy (it was
    marked failed by each paired request, out of rotation for everyone until its next
    health check; found by a review)."""
    no_connector = {
        "error": {
            "message": "kv_transfer_params need a KV connector; start the node with "
            "--kv-connector nixl",
            "type": "invalid_request_error",
            "param": "kv_transfer_params",
            "code": None,
        }
    }

    async def decode(req: SeenRequest) -> bytes:
        if (req.json().get("kv_transfer_params") or {}).get("do_remote_prefill"):
            return answer(400, no_connector)
        return chunked(200, _sse(_token(7), _token(8), _token(9, "length")))

    async def main() -> tuple[list[int], list, list[bool]]:
        async with StandIn(_node(_prefill)) as p, StandIn(_node(decode)) as d:
            cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,), health_interval=0.1)
            pool = _ready_pool(cfg)
            ids, events = await _stream(cfg, pool, Router(pool))
            return ids, events, [n.healthy for n in pool.nodes("decode")]

    ids, events, healthy = asyncio.run(main())
    assert ids == [7, 8, 9] and not any("error" in e for e in events), events
    assert healthy == [True]


def test_a_refusal_after_the_first_token_was_streamed_reruns_on_the_decode_node_alone() -> None:
    """P answers before D's refusal (without --kv-reserve-first a prefill leg does not
    wait for the reservation): P's token reached the client, and no decode node accepts
    P, so no pair can check that token. D alone reruns the request (with the seed P drew
    from); its stream repeats P's token, which is checked and dropped (found by a
    review: the stream ended with an error event)."""
    d = RefusingDecode(delay=0.3)

    async def main() -> tuple[list[int], list]:
        async with StandIn(_node(_prefill)) as p, StandIn(_node(d)) as ds:
            cfg = ProxyConfig(prefill=(p.url,), decode=(ds.url,), health_interval=0.1)
            pool = _ready_pool(cfg)
            return await _stream(cfg, pool, Router(pool))

    ids, events = asyncio.run(main())
    assert ids == [7, 8, 9] and not any("error" in e for e in events), events
    assert "".join(c.get("text") or "" for e in events for c in e["choices"]) == "t7t8t9"
    assert [bool(kv.get("remote_side_channel")) for kv in d.legs] == [True, False]


def test_a_refusal_is_remembered_for_the_nodes_the_attempt_paired_not_a_restart() -> None:
    """P restarts (a new incarnation, seen by a health check) while D's refusal of its
    old side channel is on the way: the restarted P is paired with D again (the refusal
    was stored under P's new incarnation, blocking it for 10 minutes; found by a
    review)."""
    d = RefusingDecode(delay=0.5)

    async def slow_prefill(req: SeenRequest) -> bytes:
        await asyncio.sleep(5)  # waits for a reservation that never comes (aborted)
        return answer(200, {**PREFILL_ANSWER, "model": "tiny"})

    async def main() -> bool:
        async with StandIn(_node(slow_prefill)) as p_stand, StandIn(_node(d)) as d_stand:
            cfg = ProxyConfig(prefill=(p_stand.url,), decode=(d_stand.url,), health_interval=0.1)
            pool = _ready_pool(cfg)
            router = Router(pool)
            (pn,), (dn,) = pool.nodes("prefill"), pool.nodes("decode")
            pn.update_info({"side_channel": "tcp://127.0.0.1:1", "incarnation": "old"}, None)

            async def restart() -> None:
                await asyncio.sleep(0.2)
                pn.update_info({"side_channel": "tcp://127.0.0.1:1", "incarnation": "new"}, None)

            task = asyncio.ensure_future(restart())
            body = await _request(cfg, pool, router, stream=False)
            await task
            assert body["choices"][0]["token_ids"] == [7, 8, 9], body
            return (pn.url, "old", pn.side_channel, dn.url, dn.incarnation) in router._refused

    assert asyncio.run(main())  # the refusal is P's old incarnation's
    # The restarted P was paired again (and refused again: this D refuses every P), then
    # D served alone.
    assert [bool(kv.get("remote_side_channel")) for kv in d.legs] == [True, True, False]
