"""What a vLLM user expects from the nodes' CLI and API, found missing by a new-user
walkthrough: ``/ping``, ``return_token_ids``, ``--chat-template`` and a request's
``chat_template`` (``--trust-request-chat-template``), and the vLLM flags a node accepted
as unrecognized before. In-process: a node app over a scripted engine, the parsers."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from fastapi.testclient import TestClient

from engine.outputs import RequestOutput
from engine.server.app import build_app
from engine.tokenizer import ByteTokenizer

MSGS = [{"role": "user", "content": "hi"}]


class ScriptedEngine:
    """Answers ``text`` (its bytes as tokens) to every request; keeps each request's
    prompt ids and sampling parameters."""

    def __init__(self, text: str = "ok", tokenizer: Any = None) -> None:
        self.text = text
        self.model_name, self.max_model_len, self.vocab_size = "m", 4096, 512
        self.tokenizer = tokenizer or ByteTokenizer()
        self.healthy, self.dead_reason = True, None
        self.grammars = SimpleNamespace(compile=lambda so: None)
        self.seen: list[tuple[list[int], Any]] = []

    async def generate(self, request_id: str, prompt_ids: list[int], params: Any, **kw: Any) -> Any:
        self.seen.append((list(prompt_ids), params))
        ids = list(self.text.encode())
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            yield RequestOutput(request_id, [t], last, "length" if last else None)

    async def abort(self, request_id: str) -> None:
        return None

    async def abort_matching(self, key: str, by: str = "request_id") -> list[str]:
        return []

    def stats(self) -> dict[str, Any]:
        return {}

    def kv_info(self) -> dict[str, Any]:
        return {"engine_id": "e"}


def _client(engine: ScriptedEngine | None = None, **kw: Any) -> TestClient:
    return TestClient(build_app(engine or ScriptedEngine(), **kw))  # type: ignore[arg-type]


def _events(resp: Any) -> list[dict[str, Any]]:
    lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


# -- /ping ----------------------------------------------------------------------------------------


def test_ping_answers_like_health_on_get_and_post_without_the_api_key() -> None:
    engine = ScriptedEngine()
    client = _client(engine, api_key="k")
    for method in ("GET", "POST"):
        resp = client.request(method, "/ping")
        assert resp.status_code == 200, (method, resp.text)
    engine.healthy, engine.dead_reason = False, "worker died"
    resp = client.post("/ping")
    assert resp.status_code == 503 and "worker died" in resp.text


def test_the_proxy_answers_ping_like_health() -> None:
    from proxy.app import build_app as build_proxy
    from proxy.config import ProxyConfig

    cfg = ProxyConfig(prefill=("http://127.0.0.1:9",), decode=("http://127.0.0.1:9",),
                      health_interval=60.0, health_timeout=1.0, api_key="k")  # fmt: skip
    app = build_proxy(cfg)
    with TestClient(app) as client:
        for method in ("GET", "POST"):  # no node is reachable: unavailable, as /health says
            assert client.request(method, "/ping").status_code == 503
        assert client.get("/health").status_code == 503
        for node in app.state.pool.all():
            node.set_healthy(True)
            node.update_info({"side_channel": "tcp://127.0.0.1:5600"}, {"data": [{"id": "m"}]})
        for method in ("GET", "POST"):
            resp = client.request(method, "/ping")
            assert resp.status_code == 200, resp.text
            assert resp.json()["status"] == "ok"
