"""A large answer (prompt log probabilities of a long prompt, for many choices) is built and
rendered off the event loop, in pieces: the node's other clients (``/health``, streams) keep
being served meanwhile (an in-process node app, a stand-in engine)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx

from engine.httpkit.big_json import render_json
from engine.outputs import RequestOutput, TokenLogprob
from engine.server.app import build_app
from engine.tokenizer import ByteTokenizer

PROMPT_TOKENS = 4000
TOP = 20


class PromptLogprobsEngine:
    """Every request answers one token, with ``TOP`` alternatives for each prompt token."""

    def __init__(self) -> None:
        self.model_name, self.max_model_len, self.vocab_size = "m", 4096, 512
        self.tokenizer = ByteTokenizer()
        self.healthy, self.dead_reason = True, None
        self.grammars = SimpleNamespace(compile=lambda so: None)
        top_ids = tuple(range(TOP))
        top_lps = tuple(-0.5 - i for i in range(TOP))
        self.entry = TokenLogprob(104, -1.25, top_ids, top_lps, 3)

    async def generate(self, request_id: str, prompt: list[int], *a: Any, **kw: Any) -> AsyncIterator[Any]:  # fmt: skip
        entries = [None, *[self.entry] * (len(prompt) - 1)]
        yield RequestOutput(request_id, [105], True, "length", prompt_logprobs=entries)

    async def abort(self, request_id: str) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def kv_info(self) -> dict[str, Any]:
        return {"engine_id": "e"}


async def _worst_loop_gap_during(work: Any) -> tuple[Any, float, float]:
    """Runs ``work`` while a ticker on the same loop wakes every 5 ms: its answer, the
    longest the ticker waited, and how long ``work`` took."""
    worst, done = 0.0, False

    async def ticker() -> None:
        nonlocal worst
        last = time.monotonic()
        while not done:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            worst, last = max(worst, now - last), now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.monotonic()
    result = await work
    took = time.monotonic() - start
    done = True
    await tick
    return result, worst, took


def test_a_huge_answer_does_not_stall_the_event_loop() -> None:
    app = build_app(PromptLogprobsEngine())  # type: ignore[arg-type]
    body = {"prompt": "h" * PROMPT_TOKENS, "max_tokens": 1, "prompt_logprobs": TOP, "n": 8}

    async def main() -> tuple[httpx.Response, float, float]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://n") as client:
            return await _worst_loop_gap_during(client.post("/v1/completions", json=body))

    resp, worst, took = asyncio.run(main())
    assert resp.status_code == 200, resp.text[:300]
    choices = resp.json()["choices"]
    assert len(choices) == 8 and all(len(c["prompt_logprobs"]) == PROMPT_TOKENS for c in choices)
    assert choices[3]["prompt_logprobs"][1]["104"]["rank"] == 3
    # Unfixed: building and dumping the ~45 MB answer was one block of the loop (~95%).
    assert worst < 0.4 * took, (worst, took)


def test_render_json_is_json_dumps_as_starlette_renders_it() -> None:
    body = {
        "a": [{"x": i, "s": "é\u2028"} for i in range(2000)],
        "b": {"c": [[1, 2]] * 700, "d": []},
        "e": [],
        "f": None,
        "g": [{"deep": list(range(3000))}],
        "h": 1.5,
        "t": '"quoted"',
    }
    want = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    assert render_json(body) == want.encode()
