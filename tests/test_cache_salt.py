"""vLLM's ``cache_salt``: prefix-cache isolation between tenants. The salt is mixed into
the hash of a request's first KV block (every later hash chains from it), so requests with
different salts never share cached blocks; a request without one behaves as before.

In process: the engine's prefix cache (the offline ``LLM``, tiny model, ``uni``), the
node's HTTP layer (a scripted engine: 400s naming ``cache_salt``, the salt handed to the
engine on completions, chat and ``/v1/responses``), the proxy's entry checks (its app, no
nodes) and its prefix-aware routing key. The P/D legs: ``test_disagg.py``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from scripted_engine import ScriptedEngine
from starlette.testclient import TestClient

from engine import LLM, SamplingParams
from engine.server.app import build_app
from engine.server.chat_protocol import parse_chat_request
from engine.server.field_parsers import MAX_CACHE_SALT_CHARS
from engine.server.protocol import parse_completion_request
from proxy.app import build_app as build_proxy_app
from proxy.config import ProxyConfig
from proxy.prefix import PrefixIndex, prompt_key

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BS = 16  # the engine's default --block-size
BAD_SALTS = [123, 1.5, True, "", ["a"], {"a": "b"}, "x" * (MAX_CACHE_SALT_CHARS + 1)]
MESSAGES = [{"role": "user", "content": "hello"}]


# -- the engine's prefix cache ---------------------------------------------------------------


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(model="tiny", device="cpu", num_blocks=256, max_model_len=512) as engine:
        yield engine


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 255) for _ in range(4 * BS + 5)]  # four full blocks, then five


def _hits(llm: LLM) -> int:
    return llm.core.scheduler.stats().prompt_tokens_by_source_total["local_cache_hit"]


def _run(llm: LLM, prompt: list[int], salt: str | None) -> tuple[list[int], int]:
    """The greedy answer to ``prompt`` under ``salt``, and its prefix-cache hits (tokens)."""
    item: dict[str, Any] = {"prompt_token_ids": prompt}
    if salt is not None:
        item["cache_salt"] = salt
    before = _hits(llm)
    out = llm.generate(item, GREEDY)[0]
    return out.outputs[0].token_ids, _hits(llm) - before


def test_different_salts_share_no_cached_block_and_the_same_salt_does(llm: LLM) -> None:
    prompt = _prompt(1)
    cached = 4 * BS
    answer, hits = _run(llm, prompt, "tenant-a")
    assert hits == 0
    assert _run(llm, prompt, "tenant-b") == (answer, 0)  # another tenant: no hit
    assert _run(llm, prompt, None) == (answer, 0)  # no salt: not the salted blocks
    assert _run(llm, prompt, "tenant-a") == (answer, cached)  # its own blocks
    assert _run(llm, prompt, "tenant-b") == (answer, cached)
    assert _run(llm, prompt, None) == (answer, cached)  # unsalted hits unsalted, as before


def test_a_salt_isolates_a_prompt_computed_in_the_same_step(llm: LLM) -> None:
    """Requests in one batch wait for the blocks a step computes for another request
    with the same prefix (``KVCacheManager.computing``), never for another salt's."""
    prompt = _prompt(2)
    items = [{"prompt_token_ids": prompt, "cache_salt": s} for s in ("a", "b", "a")]
    before = _hits(llm)
    outs = llm.generate(items, GREEDY)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert _hits(llm) - before == 4 * BS  # the second "a" from the first's blocks alone


@pytest.mark.parametrize("salt", BAD_SALTS, ids=lambda s: repr(s)[:20])
def test_the_offline_api_refuses_what_a_node_refuses(llm: LLM, salt: Any) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "cache_salt": salt}, GREEDY)


# -- a node's HTTP layer ---------------------------------------------------------------------


class SaltRecorder(ScriptedEngine):
    """A scripted engine that keeps each request's ``cache_salt``."""

    def __init__(self) -> None:
        super().__init__("ok")
        self.salts: list[str | None] = []

    async def generate(self, request_id: str, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        self.salts.append(kw.get("cache_salt"))
        async for out in super().generate(request_id, *args, **kw):
            yield out


@pytest.fixture
def node() -> tuple[TestClient, SaltRecorder]:
    engine = SaltRecorder()
    return TestClient(build_app(engine)), engine  # type: ignore[arg-type]


BODIES = {
    "/v1/completions": {"model": "m", "prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {"model": "m", "messages": MESSAGES, "max_tokens": 4},
    "/v1/responses": {"model": "m", "input": "hello", "max_output_tokens": 4},
}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("salt", BAD_SALTS, ids=lambda s: repr(s)[:20])
def test_a_node_refuses_a_salt_that_is_no_short_nonempty_string(node, path, salt) -> None:
    client, engine = node
    resp = client.post(path, json={**BODIES[path], "cache_salt": salt})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "cache_salt", resp.text
    assert engine.salts == []


@pytest.mark.parametrize("path", list(BODIES))
def test_a_node_hands_the_salt_to_the_engine(node, path) -> None:
    client, engine = node
    longest = "s" * MAX_CACHE_SALT_CHARS
    for salt in ("tenant-a", longest, None):
        body = dict(BODIES[path])
        if salt is not None:
            body["cache_salt"] = salt
        resp = client.post(path, json=body)
        assert resp.status_code == 200, resp.text
    assert engine.salts == ["tenant-a", longest, None]


def test_every_choice_of_a_request_carries_its_salt(node) -> None:
    client, engine = node
    body = {**BODIES["/v1/completions"], "prompt": ["a", "b"], "n": 2, "cache_salt": "t"}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.salts == ["t"] * 4


# -- the proxy -------------------------------------------------------------------------------


def proxy_entry_answers(name: str, value: Any) -> list[httpx.Response]:
    """A proxy's answers to ``BODIES`` with ``name`` set to ``value``, from a proxy app
    without its lifespan: no node is ever asked, so only its entry checks answer."""
    cfg = ProxyConfig(prefill=("http://10.0.0.1:8100",), decode=("http://10.0.0.2:8200",))
    app = build_proxy_app(cfg)

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return [
                await client.post(path, json={**body, "model": "tiny", name: value})
                for path, body in BODIES.items()
            ]

    return asyncio.run(main())


@pytest.mark.parametrize("salt", BAD_SALTS, ids=lambda s: repr(s)[:20])
def test_the_proxy_refuses_a_bad_salt_before_any_node(salt: Any) -> None:
    for resp in proxy_entry_answers("cache_salt", salt):
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "cache_salt", resp.text


def test_the_routing_key_of_a_salted_prompt_is_its_tenants_own() -> None:
    text = "The same long system prompt, shared by every tenant. " * 8

    def completion(salt: str | None) -> Any:
        body: dict[str, Any] = {"prompt": text}
        if salt is not None:
            body["cache_salt"] = salt
        return prompt_key(parse_completion_request(body))

    def chat(salt: str | None) -> Any:
        body: dict[str, Any] = {"messages": [{"role": "system", "content": text}]}
        if salt is not None:
            body["cache_salt"] = salt
        return prompt_key(parse_chat_request(body))

    def ids(salt: str | None) -> Any:
        body: dict[str, Any] = {"prompt": list(range(1, 70))}
        if salt is not None:
            body["cache_salt"] = salt
        return prompt_key(parse_completion_request(body))

    for key in (completion, chat, ids):
        a, b, plain = key("a"), key("b"), key(None)
        assert a.hashes and a == key("a")
        assert not {a.hashes[0], b.hashes[0], plain.hashes[0]} & set(a.hashes[1:] + b.hashes[1:])
        assert len({a.hashes[0], b.hashes[0], plain.hashes[0]}) == 3, key.__name__
        # An answer extends a salted key within its tenant's chain.
        more = "x" * 64 if a.kind != "ids" else list(range(16))
        assert a.extend(more).hashes[: len(a.hashes)] == a.hashes
        assert a.extend(more).hashes[-1] != plain.extend(more).hashes[-1]

    index = PrefixIndex(1000)
    index.insert("http://d1", completion("a"))
    assert index.match("http://d1", completion("a")) == len(completion("a").hashes)
    assert index.match("http://d1", completion("b")) == 0
    assert index.match("http://d1", completion(None)) == 0
