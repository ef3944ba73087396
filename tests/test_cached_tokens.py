"""Prompt tokens served from the prefix cache: the offline ``RequestOutput``'s
``num_cached_tokens`` and, on a node with ``--enable-prompt-tokens-details`` (vLLM's
flag), the usage's ``prompt_tokens_details.cached_tokens`` -- absent without the flag, and
(as vLLM) absent when nothing was cached."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine import LLM, SamplingParams

# 80 one-byte tokens of the tiny model: 5 full blocks of 16.
PROMPT = "The quick brown fox jumps over the lazy dog, again and again, until it tires out."


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(model="tiny", device="cpu", num_blocks=128, max_model_len=256) as engine:
        yield engine


def test_offline_num_cached_tokens_of_a_repeated_prompt(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([PROMPT], sp)[0]
    again = llm.generate([PROMPT], sp)[0]
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    # Every full block but the one holding the last prompt token (it is computed again).
    assert again.num_cached_tokens == (n - 1) // 16 * 16 > 0


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[bool, Any]]:
    """Two nodes' apps on one event loop: with ``--enable-prompt-tokens-details`` (True)
    and without (False)."""
    from inproc_node import uni_config

    from engine.async_engine import AsyncLLMEngine
    from engine.server.app import build_app

    engines = [AsyncLLMEngine(uni_config(num_blocks=128), "WARNING") for _ in range(2)]
    loop = asyncio.new_event_loop()
    try:
        apps = {
            flag: build_app(e, prompt_tokens_details=flag)
            for flag, e in zip((True, False), engines, strict=True)
        }
        yield {flag: (app, loop) for flag, app in apps.items()}
    finally:
        for e in engines:
            e.shutdown()
        loop.close()


def _usage(node: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The answer's usage: the body's, or a stream's usage chunk."""
    app, loop = node

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://n") as client:
            return await client.post(path, json={"model": "tiny", "max_tokens": 2, **body})

    resp = loop.run_until_complete(main())
    assert resp.status_code == 200, resp.text[:300]
    if not body.get("stream"):
        return resp.json()["usage"]
    chunks = [
        json.loads(line[6:]) for line in resp.text.splitlines()
        if line.startswith("data: {")
    ]  # fmt: skip
    last = [c for c in chunks if not c["choices"] and c.get("usage")]
    assert len(last) == 1, chunks
    for c in chunks[:-1]:  # continuous usage stats carry no details (vLLM's)
        assert "prompt_tokens_details" not in (c.get("usage") or {})
    return last[0]["usage"]


def _body(chat: bool, text: str, stream: bool) -> dict[str, Any]:
    """A request whose cache is its own (``cache_salt``: the text)."""
    body: dict[str, Any] = {"stream": stream, "temperature": 0, "cache_salt": text}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_node_with_the_flag_reports_the_prompts_cached_tokens(
    nodes: dict[bool, Any], chat: bool, stream: bool
) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    text = f"({'chat' if chat else 'text'}, {'streamed' if stream else 'whole'}) {PROMPT}"
    first = _usage(nodes[True], path, _body(chat, text, stream))
    again = _usage(nodes[True], path, _body(chat, text, stream))
    assert "prompt_tokens_details" not in first, first  # nothing cached: absent, as vLLM
    n = again["prompt_tokens"]
    assert again["prompt_tokens_details"] == {"cached_tokens": (n - 1) // 16 * 16}, again
    assert again["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_without_the_flag_the_usage_has_no_prompt_tokens_details(
    nodes: dict[bool, Any], stream: bool
) -> None:
    text = f"(no flag, {stream}) {PROMPT}"
    for _ in range(2):
        usage = _usage(nodes[False], "/v1/completions", _body(False, text, stream))
        assert "prompt_tokens_details" not in usage, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_and_a_batch_sum_each_prompts_cached_tokens_once(
    nodes: dict[bool, Any], stream: bool
) -> None:
    """Each prompt counted once, as ``prompt_tokens`` counts it: its first choice's."""
    texts = [f"(batch {stream} {i}) {PROMPT}" for i in range(2)]
    body = {**_body(False, "", stream), "prompt": texts, "n": 2, "cache_salt": str(stream)}
    _usage(nodes[True], "/v1/completions", body)
    again = _usage(nodes[True], "/v1/completions", body)
    per_prompt = [(len(t.encode()) - 1) // 16 * 16 for t in texts]
    assert again["prompt_tokens_details"] == {"cached_tokens": sum(per_prompt)}, again


def test_responses_input_tokens_details_follow(nodes: dict[bool, Any]) -> None:
    app, loop = nodes[True]
    text = f"(responses) {PROMPT}"

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://n") as client:
            body = {"model": "tiny", "input": text, "max_output_tokens": 2, "cache_salt": text}
            return await client.post("/v1/responses", json=body)

    assert (
        loop.run_until_complete(main()).json()["usage"]["input_tokens_details"]["cached_tokens"]
        == 0
    )
    usage = loop.run_until_complete(main()).json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] > 0, usage


@pytest.mark.parametrize("value", [-1, 1.5, True, "80", 121])
def test_a_prefill_nodes_bad_count_is_ignored_with_a_warning(
    value: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from proxy.cached_tokens import prefill_cached_tokens

    body = {"kv_transfer_params": {"num_cached_tokens": value}}
    assert prefill_cached_tokens(body, 120, "r") is None
    assert "num_cached_tokens" in caplog.text
    assert prefill_cached_tokens({"kv_transfer_params": {"num_cached_tokens": 80}}, 120, "r") == 80
    assert prefill_cached_tokens({"kv_transfer_params": {}}, 120, "r") is None


def test_a_decode_leg_carrying_ps_count_back_is_served(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's toy proxy sends P's answer's params on to D: the count is known, and a bad
    one is dropped with a warning, not a 400."""
    from kvconnector.params import KVTransferParams

    leg = {"do_remote_prefill": True, "transfer_id": "t", "remote_side_channel": "tcp://h:1"}
    assert KVTransferParams.from_dict({**leg, "num_cached_tokens": 16}).num_cached_tokens == 16
    assert KVTransferParams.from_dict({**leg, "num_cached_tokens": -3}).num_cached_tokens is None
    assert "num_cached_tokens" in caplog.text
