"""Stand-in nodes and a scripted resolver for the tests of nodes coming and going while
requests run on them (``tests/test_proxy_churn.py``, ``tests/test_property_proxy_dns.py``):
stand-ins on loopback addresses (``127.0.0.K``, one port per role, as a headless
service's pods) whose ``/health`` answers, hangs or refuses and whose completions can be
held in flight; the proxy in process, its DNS refreshes and health rounds run by hand."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.app import build_app
from proxy.config import ProxyConfig
from proxy.nodes import Node
from tests.standin_http import SeenRequest, StandIn, answer, chunked, node_facts

KEY = "churn-key"
BODY = {"model": "tiny", "prompt": "x", "max_tokens": 3}


@dataclass
class Script:
    """How a stand-in answers: ``health`` "ok", "503" or "hang" (never answers); with
    ``hold``, each completion waits for its own gate (``release``) so that it stays in
    flight."""

    health: str = "ok"
    hold: bool = False
    # One per held completion, by its transfer id (in arrival order).
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    fail: bool = False  # a completion let through its gate answers 500
    hold_ids: set[str] = field(default_factory=set)  # request ids held (without ``hold``)
    arrived: Callable[[str], None] | None = None  # told each completion's transfer id

    @property
    def held(self) -> int:
        return len([g for g in self.gates.values() if not g.is_set()])

    def release(self, k: int) -> None:
        list(self.gates.values())[k].set()

    def release_all(self) -> None:
        """Let every held completion go, and hold none from now on."""
        self.hold, self.hold_ids = False, set()
        for gate in self.gates.values():
            gate.set()

    health_seen: asyncio.Event = field(default_factory=asyncio.Event)


def handler(kv_role: str, script: Script) -> Callable[[SeenRequest], Any]:
    async def handle(req: SeenRequest) -> Any:
        if req.path == "/health":
            script.health_seen.set()
            if script.health == "hang":
                await asyncio.sleep(3600)
            if script.health == "503":
                return answer(503, {"status": "starting"})
        facts = node_facts(req, kv_role)
        if facts is not None:
            return facts
        tid = str((req.json().get("kv_transfer_params") or {}).get("transfer_id"))
        if script.arrived is not None:
            script.arrived(tid)
        if script.hold or tid.split("-", 1)[0] in script.hold_ids:
            gate = asyncio.Event()
            script.gates[tid if tid != "None" else str(len(script.gates))] = gate
            await gate.wait()
        if script.fail:
            return answer(500, {"error": {"message": "engine failed", "type": "server_error"}})
        if kv_role == "consumer" and req.json().get("stream"):
            events = [{"choices": [{"index": 0, "text": f"t{i}", "token_ids": [i],
                                    "finish_reason": "length" if i == 9 else None}],
                       "model": "tiny"} for i in (7, 8, 9)]  # fmt: skip
            pieces = [f"data: {json.dumps(e)}\n\n".encode() for e in events]
            return chunked(200, [*pieces, b"data: [DONE]\n\n"])
        first = {"kv_transfer_params": {"first_token": 7}} if kv_role == "producer" else {}
        choice = {"index": 0, "text": "t7t8t9", "token_ids": [7, 8, 9], "finish_reason": "length"}
        return answer(200, {"choices": [choice], "model": "tiny", **first})

    return handle


class HostStandIn(StandIn):
    """A stand-in at ``host`` (a loopback address) and ``port`` (0: any)."""

    def __init__(self, handle: Any, host: str, port: int = 0) -> None:
        super().__init__(handle)
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def __aenter__(self) -> HostStandIn:
        self.server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self


def completions(node: HostStandIn | StandIn) -> int:
    return len([r for r in node.seen if r.path == "/v1/completions"])


def aborts(node: HostStandIn | StandIn) -> list[Any]:
    return [r.json() for r in node.seen if r.path == "/v1/abort"]


async def until(ready: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not ready():
            await asyncio.sleep(0.005)
    assert ready(), what


@contextlib.asynccontextmanager
async def proxy_app(cfg: ProxyConfig, resolver: Any = None) -> AsyncIterator[tuple[Any, Any]]:
    app = build_app(cfg, resolver) if resolver is not None else build_app(cfg)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=30) as c:
            yield app, c


def in_flight_settled(app: Any) -> None:
    """Every node watched, and the proxy's per-node view, count nothing in flight."""
    pool = app.state.pool
    for n in pool.watched():
        assert n.outstanding == 0 and n.in_flight == 0, (n.url, n.outstanding)
    assert pool.leaving() == []


def node_at(app: Any, url: str) -> Node | None:
    node: Node | None = app.state.pool.get(url)
    return node


class Resolver:
    """A DNS name's answers, set by the test: addresses, an exception, or ``"hang"``
    (the lookup blocks until ``release``)."""

    def __init__(self) -> None:
        self.answer: list[str] | Exception | str = []
        self.release = threading.Event()

    def __call__(self, name: str) -> list[str]:
        answer = self.answer
        if answer == "hang":
            self.release.wait(30)
            raise OSError("released")
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, list)
        return list(answer)


def transfer_ids(node: StandIn) -> list[str]:
    """The transfer ids of the completions ``node`` was asked for, in order."""
    seen = [r.json() for r in node.seen if r.path == "/v1/completions"]
    return [str((b.get("kv_transfer_params") or {}).get("transfer_id")) for b in seen]


def metric(text: str, name: str, url: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'url="{url}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


async def register(client: httpx.AsyncClient, url: str, join: bool = True) -> None:
    path = "/v1/nodes/register" if join else "/v1/nodes/deregister"
    resp = await client.post(path, json={"role": "decode", "url": url},
                             headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert resp.status_code == 200, resp.text


def health_calls(node: StandIn) -> int:
    return len([r for r in node.seen if r.path == "/health"])
