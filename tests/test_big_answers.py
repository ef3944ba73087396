"""A large answer (prompt log probabilities of a long prompt, for many choices) is built and
rendered off the event loop, in pieces: the node's other clients (``/health``, streams) keep
being served meanwhile (an in-process node app, a stand-in engine)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from scripted_engine import StubEngine
from standin_http import SeenRequest, StandIn, answer

from engine.httpkit.big_json import render_event, render_json
from engine.httpkit.sse import sse_event
from engine.outputs import RequestOutput, TokenLogprob
from engine.server.app import build_app
from proxy.app import build_app as build_proxy
from proxy.config import ProxyConfig

PROMPT_TOKENS = 4000
TOP = 20
# The share of a request's time the event loop may be held at once.
HELD = 0.4


class PromptLogprobsEngine(StubEngine):
    """Every request answers one token, with ``TOP`` alternatives for each prompt token."""

    def __init__(self) -> None:
        super().__init__()
        top_ids = tuple(range(TOP))
        top_lps = tuple(-0.5 - i for i in range(TOP))
        self.entry = TokenLogprob(104, -1.25, top_ids, top_lps, 3)

    async def generate(self, request_id: str, prompt: list[int], *a: Any, **kw: Any) -> AsyncIterator[Any]:  # fmt: skip
        entries = [None, *[self.entry] * (len(prompt) - 1)]
        yield RequestOutput(request_id, [105], True, "length", prompt_logprobs=entries)


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


@contextlib.asynccontextmanager
async def _client_of(app: Any, base: str = "http://n") -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of ``app``, in process."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=base) as client:
        yield client


@contextlib.asynccontextmanager
async def _proxy_over(
    node: Any, max_model_len: int
) -> AsyncIterator[tuple[httpx.AsyncClient, StandIn]]:
    """A client of an in-process proxy whose one decode node (ready, ``max_model_len``
    long) is the stand-in ``node``; and the stand-in."""
    async with StandIn(node) as d:
        app = build_proxy(ProxyConfig(prefill=(), decode=(d.url,), prefill_fallback=True))
        async with app.router.lifespan_context(app):
            models = {"data": [{"id": "m", "max_model_len": max_model_len}]}
            for n in app.state.pool.all():
                n.update_info({"role": "consumer"}, models)
                n.set_healthy(True)
            async with _client_of(app, "http://p") as client:
                yield client, d


def _least_held(
    run: Callable[[], tuple[Any, float, float]], tries: int = 3
) -> tuple[Any, float, float]:
    """``run()`` (an answer, the loop's longest wait, the time taken) until the loop was
    not held for ``HELD`` of the time, at most ``tries`` times: a busy machine may
    deschedule the ticker once, while code that blocks the loop holds it on every try."""
    for _ in range(tries):
        result, worst, took = run()
        if worst < HELD * took:
            break
    return result, worst, took


def test_a_huge_answer_does_not_stall_the_event_loop() -> None:
    app = build_app(PromptLogprobsEngine())  # type: ignore[arg-type]
    body = {"prompt": "h" * PROMPT_TOKENS, "max_tokens": 1, "prompt_logprobs": TOP, "n": 8}

    async def main() -> tuple[httpx.Response, float, float]:
        async with _client_of(app) as client:
            return await _worst_loop_gap_during(client.post("/v1/completions", json=body))

    resp, worst, took = _least_held(lambda: asyncio.run(main()))
    assert resp.status_code == 200, resp.text[:300]
    choices = resp.json()["choices"]
    assert len(choices) == 8 and all(len(c["prompt_logprobs"]) == PROMPT_TOKENS for c in choices)
    assert choices[3]["prompt_logprobs"][1]["104"]["rank"] == 3
    # Unfixed: dumping the ~45 MB answer was one block of the loop (~45% of the time).
    assert worst < HELD * took, (worst, took)


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
    assert render_event(body) == sse_event(body)


def test_the_proxys_huge_answer_does_not_stall_its_event_loop() -> None:
    """The proxy merges its choices' answers (each a node's) and renders the whole body off
    its event loop too (a stand-in decode node serving alone, ``--prefill-fallback``)."""

    entry = {str(i): {"logprob": -0.5 - i, "rank": i + 1, "decoded_token": "é"} for i in range(TOP)}  # fmt: skip
    choice = {"index": 0, "text": "i", "finish_reason": "length", "token_ids": [105]}
    one = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{**choice, "prompt_logprobs": [None, *[entry] * (PROMPT_TOKENS - 1)]}],
           "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1,
                     "total_tokens": PROMPT_TOKENS + 1}}  # fmt: skip
    raw = answer(200, one)

    async def node(req: SeenRequest) -> bytes:
        if req.path == "/v1/completions":
            return raw
        if req.path == "/v1/models":
            return answer(200, {"data": [{"id": "m", "max_model_len": 4096}]})
        if req.path == "/v1/kv_transfer_info":
            return answer(200, {"role": "consumer", "side_channel": "tcp://10.0.0.1:5600"})
        return answer(200, {"status": "ok"})

    body = {"prompt": "h" * PROMPT_TOKENS, "max_tokens": 1, "prompt_logprobs": TOP, "n": 16}

    async def main() -> tuple[httpx.Response, float, float]:
        async with _proxy_over(node, 4096) as (c, _):
            return await _worst_loop_gap_during(c.post("/v1/completions", json=body))

    resp, worst, took = _least_held(lambda: asyncio.run(main()))
    assert resp.status_code == 200, resp.text[:300]
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == list(range(16))
    assert choices[7]["prompt_logprobs"][5]["3"]["rank"] == 4
    # Unfixed: parsing the 16 node answers (~5.6 MB each) and rendering the merged ~90 MB
    # body held the proxy's loop ~45% of the time; now its longest wait is one parse.
    assert worst < HELD * took, (worst, took)


# -- a bound on the log probabilities one answer holds (--max-logprob-entries) -----------------


class OneTokenEngine(PromptLogprobsEngine):
    """A 32k-context stand-in answering one token without log probabilities (cheap, so a
    request the bound should refuse is answered quickly when it is not); counts requests."""

    def __init__(self) -> None:
        super().__init__()
        self.max_model_len, self.started = 32768, 0

    async def generate(self, request_id: str, prompt: list[int], *a: Any, **kw: Any) -> AsyncIterator[Any]:  # fmt: skip
        self.started += 1
        yield RequestOutput(request_id, [105], True, "length")


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def main() -> httpx.Response:
        async with _client_of(app) as client:
            return await client.post(path, json=body)

    return asyncio.run(main())


def test_a_node_refuses_choices_whose_log_probabilities_pass_the_bound() -> None:
    """n = 16 with ``logprobs: 20`` and ``max_tokens`` 30,000 on a 32k-context model may
    answer 16 x 30k x 21 = 10M entries (~3 GB held while built): a 400 naming ``n``, the
    flag and the fix, before any choice starts. Realistic requests are left alone."""
    engine = OneTokenEngine()
    app = build_app(engine)  # type: ignore[arg-type]
    body = {"prompt": "hello", "n": 16, "logprobs": 20, "max_tokens": 30000}
    resp = _post(app, "/v1/completions", body)
    # Unfixed: 200 (each choice could have generated 32k tokens with 21 entries each).
    assert resp.status_code == 400, resp.text[:300]
    err = resp.json()["error"]
    assert err["param"] == "n" and "--max-logprob-entries 10000000" in err["message"]
    assert "'logprobs' 20" in err["message"] and "fewer choices" in err["message"]
    assert engine.started == 0
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "n": 16,
        "logprobs": True,
        "top_logprobs": 20,
    }  # fmt: skip  (no max_tokens: the rest of the context)
    err = _post(app, "/v1/chat/completions", chat).json()["error"]
    assert err["param"] == "n" and "'top_logprobs' 20" in err["message"]
    assert _post(app, "/v1/chat/completions", {**chat, "top_logprobs": 5}).status_code == 200
    batch = {"prompt": ["a", "b"], "max_tokens": 16000, "logprobs": 20, "echo": True}
    assert _post(app, "/v1/completions", {**batch, "n": 16}).json()["error"]["param"] == "n"
    err = _post(app, "/v1/completions", {**batch, "prompt": ["a"] * 40}).json()["error"]
    assert err["param"] == "prompt"
    for ok in (
        {"prompt": "hello", "n": 128, "logprobs": 20},  # max_tokens 16, the default
        {"prompt": "hello", "n": 16, "logprobs": 20, "max_tokens": 4000},
        {"prompt": "hello", "logprobs": 20, "echo": True, "prompt_logprobs": 20},  # one choice
        {"prompt": "hello", "n": 128},  # no log probabilities
    ):
        assert _post(app, "/v1/completions", ok).status_code == 200, ok
    small = build_app(OneTokenEngine(), max_logprob_entries=1000)  # type: ignore[arg-type]
    body = {"prompt": "hello", "n": 2, "logprobs": 0, "max_tokens": 600}
    assert _post(small, "/v1/completions", body).status_code == 400


def test_the_proxy_refuses_choices_whose_log_probabilities_pass_the_bound() -> None:
    """The proxy splits the choices over its nodes (each leg has ``n`` = 1, which no node
    refuses): it checks the whole request before any node is touched, a prompt counted
    as at most a token per byte of its text (it has no tokenizer)."""

    one = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": "i", "finish_reason": "length"}],
           "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}  # fmt: skip

    async def node(req: SeenRequest) -> bytes:
        if req.path == "/v1/models":
            return answer(200, {"data": [{"id": "m", "max_model_len": 32768}]})
        return answer(200, one if req.path == "/v1/completions" else {"status": "ok"})

    async def main() -> tuple[list[httpx.Response], int]:
        async with _proxy_over(node, 32768) as (c, d):
            bodies = (
                {"prompt": "hello", "n": 16, "logprobs": 20, "max_tokens": 30000},
                {"prompt": "hello", "n": 16, "logprobs": 20, "max_tokens": 4000},
                {"prompt": "h" * 4000, "n": 16, "prompt_logprobs": 20, "max_tokens": 1},
            )
            seen = len(d.seen)
            out = [await c.post("/v1/completions", json=b) for b in bodies[:1]]
            completions = sum(r.path == "/v1/completions" for r in d.seen[seen:])
            out += [await c.post("/v1/completions", json=b) for b in bodies[1:]]
            return out, completions

    (refused, *fine), completions = asyncio.run(main())
    # Unfixed: 200, its 16 choices sent to the decode node.
    assert refused.status_code == 400, refused.text[:300]
    err = refused.json()["error"]
    assert err["param"] == "n" and "--max-logprob-entries 10000000" in err["message"]
    assert completions == 0
    assert [r.status_code for r in fine] == [200, 200], [r.text[:200] for r in fine]


def test_the_first_chunk_of_an_echoed_stream_does_not_stall_the_event_loop() -> None:
    """``echo`` with ``logprobs`` streamed: the first chunk carries every prompt token's
    entry (4,000 x 21 here; ~1 s per choice at 32k tokens), built and rendered off the loop
    (and, with several choices, each choice's)."""
    app = build_app(PromptLogprobsEngine())  # type: ignore[arg-type]

    async def main(body: dict[str, Any]) -> tuple[httpx.Response, float, float]:
        async with _client_of(app) as client:
            return await _worst_loop_gap_during(client.post("/v1/completions", json=body))

    body = {"prompt": "h" * PROMPT_TOKENS, "max_tokens": 1, "logprobs": TOP, "echo": True,
            "stream": True}  # fmt: skip
    for n in (1, 4):
        resp, worst, took = _least_held(lambda n=n: asyncio.run(main({**body, "n": n})))
        assert resp.status_code == 200, resp.text[:300]
        events = [json.loads(e[6:]) for e in resp.text.split("\n\n") if e[6:7] == "{"]
        firsts = {e["choices"][0]["index"]: e["choices"][0] for e in reversed(events)}
        assert sorted(firsts) == list(range(n))
        lp = firsts[n - 1]["logprobs"]
        assert len(lp["tokens"]) == PROMPT_TOKENS + 1 and len(lp["top_logprobs"][1]) == TOP + 1
        # Unfixed (n = 1): the first chunk was one block of the loop (~90% of the time).
        assert worst < HELD * took, (n, worst, took)


class OutputLogprobsEngine(PromptLogprobsEngine):
    """Every request answers ``max_tokens`` tokens at once, each with ``TOP`` alternatives."""

    async def generate(self, request_id: str, prompt: list[int], params: Any, *a: Any, **kw: Any) -> AsyncIterator[Any]:  # fmt: skip
        n = params.max_tokens
        yield RequestOutput(request_id, [104] * n, True, "length", new_logprobs=[self.entry] * n)


def test_a_large_responses_answer_is_translated_whole() -> None:
    """``/v1/responses`` with ``top_logprobs`` of a long output (a ~4 MB answer): the chat
    answer is not parsed back from its bytes (one ``json.loads`` held the GIL ~0.4 s) and
    the response object is built and rendered off the loop, in pieces."""
    app = build_app(OutputLogprobsEngine())  # type: ignore[arg-type]
    body = {"model": "m", "input": "hi", "max_output_tokens": PROMPT_TOKENS, "top_logprobs": TOP}

    async def main() -> tuple[httpx.Response, float, float]:
        async with _client_of(app) as client:
            return await _worst_loop_gap_during(client.post("/v1/responses", json=body))

    resp, worst, took = _least_held(lambda: asyncio.run(main()))
    assert resp.status_code == 200, resp.text[:300]
    (message,) = resp.json()["output"]
    logprobs = message["content"][0]["logprobs"]
    assert len(logprobs) == PROMPT_TOKENS and len(logprobs[7]["top_logprobs"]) == TOP
    # The loop's longest wait is not asserted here: under CI's load (two test workers on
    # two cores) the fixed code measured as the unfixed did (~0.5 of the time), so the
    # check could not tell them apart. On an idle machine: 0.06-0.15 s of ~0.85 s, was
    # 0.43-0.51 s (docs/reliability.md).
    del worst, took


def test_a_large_responses_answer_is_rendered_once(monkeypatch: Any) -> None:
    """A large ``/v1/responses`` answer is rendered once, as the response object: the chat
    handler's answer is handed over as an object, not rendered first (a measure of the work
    done that does not depend on the machine's load)."""
    rendered: list[int] = []

    def counting(obj: Any) -> bytes:
        out = render_json(obj)
        rendered.append(len(out))
        return out

    monkeypatch.setattr("engine.httpkit.big_json.render_json", counting)
    monkeypatch.setattr("engine.responses_api.route.render_json", counting)
    app = build_app(OutputLogprobsEngine())  # type: ignore[arg-type]
    body = {"model": "m", "input": "hi", "max_output_tokens": PROMPT_TOKENS, "top_logprobs": TOP}

    async def main() -> httpx.Response:
        async with _client_of(app) as client:
            return await client.post("/v1/responses", json=body)

    resp = asyncio.run(main())
    assert resp.status_code == 200, resp.text[:300]
    assert resp.json()["object"] == "response"
    # Unfixed: the chat body (~4 MB) was rendered, its bytes dropped, then the response.
    assert rendered == [len(resp.content)], rendered
