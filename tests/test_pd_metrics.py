"""P/D requests through the proxy: the ``/metrics`` of the prefill node, the decode node and
the proxy agree with the answers the client got (docs/deploy.md, "Token counters, and
what P and D each count"; docs/proxy.md for the proxy's series).

A prefill node and a decode node (``pd_pair``: NIXL over UCX on CPU memory, real
processes) behind a real proxy get a round of requests at once: completions and chat,
streamed or not, ``n`` 2 (a P/D pair per choice), ``max_tokens`` 1 (P's token is the whole
answer), answers ended by their length, by a stop string, a stop token id or EOS on their
first token (P's token ends the answer), and by a stop string later. The answers' first
and later tokens (greedy) are found by a probe first, so the round's endings are known.

After the round, once both nodes are idle, the metrics' deltas are, for ``L`` legs (one
per choice):

- P: ``L`` requests, each its prompt and one generated token (no inter-token sample),
  finished ``stop`` when its token ended the answer, else ``length``; the HTTP layer's
  finish counts agree reason by reason.
- D: ``L`` requests by the answers' finish reasons (HTTP agreeing), the same prompts
  counted under vLLM's name, all received (``external_kv_transfer`` or a local cache hit),
  none computed (``pdserve_prompt_tokens_total``); every answer token generated, P's
  first included.
- the proxy: one ``pdproxy_requests_total{status="200"}`` per request, one request per
  leg on each node, one TTFT and one latency sample per choice, no retry, no error.

And ``cache_salt`` through the proxy: P's prefix-cache hits (its
``vllm:prompt_tokens_by_source_total``) are those of the request's own salt alone.

Both nodes run with ``--enable-prompt-tokens-details``: through the proxy an answer's
``usage.prompt_tokens_details.cached_tokens`` is P's prefix-cache hit (what a colocated
node with P's cache would report), whatever D held itself.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from harness import MODEL, PD, Procs, wait_for
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("nixl._api")

EOS = 257  # the byte tokenizer's
LETTERS = list(range(ord("a"), ord("z") + 1))  # answers of letters: stop strings to find
REASONS = ("stop", "length", "abort")
PROMPTS = [list(range(s, s + 24)) for s in (1, 40, 80, 120, 160, 200)]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(m: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in m.items() if n == name and set(labels.items()) <= set(ls))


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return val(after, name, **labels) - val(before, name, **labels)


@dataclass
class Answer:
    """One choice as the client got it."""

    finish: str
    prompt: int
    tokens: int
    stop_string: bool


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Answer]:
    chat = "messages" in body
    path = url + ("/v1/chat/completions" if chat else "/v1/completions")
    n = body.get("n", 1)
    if not body.get("stream"):
        resp = await client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        per = sorted(data["choices"], key=lambda c: c["index"])
        usage = data["usage"]
        finish = [(c["finish_reason"], isinstance(c.get("stop_reason"), str)) for c in per]
    else:
        body = {**body, "stream_options": {"include_usage": True}}
        got: dict[int, tuple[str, bool]] = {}
        usage = {}
        async with client.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices", []):
                    if c.get("finish_reason") is not None:
                        stop_str = isinstance(c.get("stop_reason"), str)
                        got[c["index"]] = (c["finish_reason"], stop_str)
        finish = [got[i] for i in range(n)]
    assert len(finish) == n and usage, (finish, usage)
    # Per choice: the usage's completion tokens split evenly (the round's n > 1 requests
    # end by their length: every choice has max_tokens).
    tokens = usage["completion_tokens"] // n
    return [Answer(r, usage["prompt_tokens"], tokens, s) for r, s in finish]


async def send_all(url: str, bodies: list[dict[str, Any]]) -> list[list[Answer]]:
    async with httpx.AsyncClient(timeout=120) as client:
        return list(await asyncio.gather(*(send(client, url, b) for b in bodies)))


@pytest.fixture(scope="module")
def pd_node_args() -> tuple[str, ...]:
    return ("--num-blocks", "256", "--enable-prompt-tokens-details")


@pytest.fixture(scope="module")
def proxy_url(pd_pair: PD, module_procs: Procs) -> str:
    return module_procs.proxy([pd_pair.p.url], [pd_pair.d.url]).url


def greedy(url: str, prompt: list[int], max_tokens: int = 4) -> list[int]:
    """The greedy answer's ids (letters)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "allowed_token_ids": LETTERS}  # fmt: skip
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def the_round(url: str) -> list[dict[str, Any]]:
    """The round's requests; the stop strings and ids from the greedy answers' tokens."""
    answers = {i: greedy(url, p) for i, p in enumerate(PROMPTS)}
    later = next((i for i in (5, 4, 3, 2, 1, 0) if answers[i][2] not in answers[i][:2]), None)
    assert later is not None, answers  # a third letter new to its answer
    first = 4 if later != 4 else 5
    base = {"model": MODEL, "temperature": 0, "max_tokens": 6, "allowed_token_ids": LETTERS}
    length = {**base, "ignore_eos": True}
    return [
        {**length, "prompt": PROMPTS[0]},
        {**length, "prompt": PROMPTS[1], "stream": True},
        {**length, "messages": [{"role": "user", "content": "P and D count this."}]},
        {**length, "messages": [{"role": "user", "content": "And this."}], "stream": True},
        {**length, "prompt": PROMPTS[2], "n": 2, "seed": 7, "temperature": 0.8},
        {**length, "prompt": PROMPTS[0], "n": 2, "seed": 8, "temperature": 0.8, "stream": True},
        {**length, "prompt": PROMPTS[3], "max_tokens": 1},
        # P's token ends the answer: a stop string, a stop token id, EOS.
        {**base, "prompt": PROMPTS[first], "stop": [chr(answers[first][0])]},
        {**base, "prompt": PROMPTS[first], "stop": [chr(answers[first][0])], "stream": True},
        {**base, "prompt": PROMPTS[first], "stop_token_ids": [answers[first][0]]},
        {
            **base,
            "prompt": PROMPTS[2],
            "logit_bias": {str(EOS): 100},
            "stream": True,
            "allowed_token_ids": None,
        },
        # A stop string past P's token.
        {**base, "prompt": PROMPTS[later], "stop": [chr(answers[later][2])]},
    ]


def finish_counts(before: Samples, after: Samples, http: bool = False) -> dict[str, float]:
    name, label = (
        ("pdserve_request_finished_total", "finish_reason")
        if http
        else ("vllm:request_success_total", "finished_reason")
    )
    return {r: delta(before, after, name, **{label: r}) for r in REASONS}


def test_pd_requests_count_once_per_leg_on_p_d_and_the_proxy(pd_pair: PD, proxy_url: str) -> None:
    bodies = the_round(proxy_url)
    urls = {"p": pd_pair.p.url, "d": pd_pair.d.url, "proxy": proxy_url}
    before = {k: scrape(u) for k, u in urls.items()}
    answers = asyncio.run(send_all(proxy_url, bodies))
    choices = [a for per in answers for a in per]
    legs = len(choices)

    def idle(k: str) -> bool:
        m = scrape(urls[k])
        return (
            delta(before[k], m, "vllm:request_success_total") == legs
            and delta(before[k], m, "pdserve_request_finished_total") == legs
            and val(m, "pdserve_num_requests_admitted") == 0
            and val(m, "pdserve_engine_num_held") == 0
            and val(m, "vllm:num_requests_running") + val(m, "vllm:num_requests_waiting") == 0
        )

    wait_for(lambda: idle("p") and idle("d"), 30, "both nodes to count every leg, idle")
    after = {k: scrape(u) for k, u in urls.items()}
    p, d, x = ((before[k], after[k]) for k in ("p", "d", "proxy"))

    # The round has what it is for.
    by_token = [a for a in choices if a.finish == "stop" and a.tokens == 1]
    assert len(by_token) == 4 and any(a.stop_string for a in by_token), choices
    assert any(a.finish == "stop" and a.tokens > 1 for a in choices), choices

    # Finish reasons: D's are the answers'; P's leg is "stop" when its token ended the
    # answer, else "length"; each node's HTTP layer counts the same.
    want_d = {r: sum(a.finish == r for a in choices) for r in REASONS}
    want_p = {"stop": len(by_token), "length": legs - len(by_token), "abort": 0}
    assert finish_counts(*d) == want_d, (finish_counts(*d), want_d)
    assert finish_counts(*p) == want_p, (finish_counts(*p), want_p)
    for side in (p, d):
        assert finish_counts(*side, http=True) == finish_counts(*side)

    prompt = sum(a.prompt for a in choices)
    answered = sum(a.tokens for a in choices)
    for side in (p, d):  # each leg's whole prompt, once, on both nodes
        assert delta(*side, "vllm:prompt_tokens_total") == prompt
        assert delta(*side, "vllm:prompt_tokens_by_source_total") == prompt
        assert delta(*side, "vllm:request_prompt_tokens_sum") == prompt
        assert delta(*side, "pdserve_request_prompt_tokens_total") == prompt
        for name in ("vllm:time_to_first_token_seconds_count",
                     "vllm:e2e_request_latency_seconds_count",
                     "vllm:request_generation_tokens_count"):  # fmt: skip
            assert delta(*side, name) == legs, name

    # P: computed the prompts (less its prefix-cache hits), one token each.
    assert delta(*p, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert delta(*p, "pdserve_prompt_tokens_total") == delta(
        *p, "vllm:prompt_tokens_by_source_total", source="local_compute"
    )
    for name in ("vllm:generation_tokens_total", "vllm:request_generation_tokens_sum",
                 "pdserve_request_completion_tokens_total"):  # fmt: skip
        assert delta(*p, name) == legs, name
    assert delta(*p, "vllm:inter_token_latency_seconds_count") == 0

    # D: received the prompts, computed none; generated every answer token, P's included
    # (and, past a stop string, what the answer left out).
    assert delta(*d, "pdserve_prompt_tokens_total") == 0
    assert delta(*d, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    gen = delta(*d, "vllm:generation_tokens_total")
    assert gen == delta(*d, "pdserve_generation_tokens_total")
    assert gen == delta(*d, "vllm:request_generation_tokens_sum")
    assert gen == legs + delta(*d, "vllm:inter_token_latency_seconds_count")
    assert answered <= gen, (answered, gen)
    if not any(a.stop_string for a in choices):
        assert gen == answered
    assert delta(*d, "pdserve_request_completion_tokens_total") == answered

    # The proxy: each request once, each leg on its node, each choice one TTFT and latency.
    assert delta(*x, "pdproxy_requests_total", status="200") == len(bodies)
    assert delta(*x, "pdproxy_requests_total") == len(bodies)
    assert delta(*x, "pdproxy_node_requests_total", role="prefill") == legs
    assert delta(*x, "pdproxy_node_requests_total", role="decode") == legs
    assert delta(*x, "pdproxy_time_to_first_token_seconds_count") == legs
    assert delta(*x, "pdproxy_request_latency_seconds_count") == legs
    assert delta(*x, "pdproxy_request_retries_total") == 0
    assert delta(*x, "pdproxy_request_errors_total") == 0


def test_a_client_gone_mid_answer_is_an_abort_on_d_alone(pd_pair: PD, proxy_url: str) -> None:
    """A stream whose client goes away after its second token (the first is P's; the
    second D's, so D's leg has begun and counted its prompt): P's leg had ended (its one
    token, "length"), D's is aborted -- or, had it run out before the proxy's abort came,
    ended by its length: either way one finish reason, its HTTP layer's too."""
    urls = {"p": pd_pair.p.url, "d": pd_pair.d.url, "proxy": proxy_url}
    before = {k: scrape(u) for k, u in urls.items()}
    body = {"model": MODEL, "prompt": PROMPTS[1][:9], "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", proxy_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        texts = 0
        for line in resp.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                texts += 1
            if texts == 2:
                break  # D's first token came: go away (after P's alone, D may be aborted
                # before its KV landed: it never ran the request nor counted its prompt)

    def counted(k: str) -> bool:
        m = scrape(urls[k])
        return (
            delta(before[k], m, "pdserve_request_finished_total") == 1
            and delta(before[k], m, "vllm:request_success_total") == 1
            and val(m, "vllm:num_requests_running") == 0
        )

    wait_for(lambda: counted("p") and counted("d"), 30, "both legs to be counted")
    wait_for(
        lambda: delta(before["proxy"], scrape(proxy_url), "pdproxy_request_errors_total") == 1,
        30, "the proxy to count the client's disconnect",
    )  # fmt: skip
    after = {k: scrape(u) for k, u in urls.items()}
    p, d, x = ((before[k], after[k]) for k in ("p", "d", "proxy"))
    assert finish_counts(*p) == {"stop": 0, "length": 1, "abort": 0}
    ended = finish_counts(*d)
    assert ended["abort"] + ended["length"] == 1 and ended["stop"] == 0, ended
    for side in (p, d):
        assert finish_counts(*side, http=True) == finish_counts(*side)
    assert delta(*d, "pdserve_prompt_tokens_total") == 0
    assert delta(*d, "vllm:prompt_tokens_total") == 9 == delta(*p, "vllm:prompt_tokens_total")
    assert delta(*x, "pdproxy_request_errors_total", kind="client_disconnect") == 1
    assert delta(*x, "pdproxy_requests_total", status="200") == 1
    assert delta(*x, "pdproxy_node_requests_total", role="prefill") == 1
    assert delta(*x, "pdproxy_node_requests_total", role="decode") == 1


def test_a_cache_salt_reaches_both_legs_and_prefill_hits_only_its_own(
    pd_pair: PD, proxy_url: str
) -> None:
    """``cache_salt`` through the proxy: the body goes to both legs, P's prefix cache hits
    only blocks of the same salt (``vllm:prompt_tokens_by_source_total``), and every
    answer is token-identical to the decode node's own, colocated and unsalted."""
    prompt = list(range(3, 3 + 5 * 16 + 3))  # five full blocks and three tokens
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "allowed_token_ids": LETTERS}  # fmt: skip

    def ids(url: str, salt: str | None) -> list[int]:
        one = body if salt is None else {**body, "cache_salt": salt}
        resp = httpx.post(url + "/v1/completions", json=one, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    def p_hits() -> float:
        return val(scrape(pd_pair.p.url), "vllm:prompt_tokens_by_source_total",
                   source="local_cache_hit")  # fmt: skip

    colocated = ids(pd_pair.d.url, None)
    hits: list[float] = []
    for salt in ("tenant-a", "tenant-a", "tenant-b", "tenant-b"):
        before = p_hits()
        assert ids(proxy_url, salt) == colocated, salt
        hits.append(p_hits() - before)
    assert hits == [0, 5 * 16, 0, 5 * 16]


def test_cached_tokens_through_the_proxy_are_the_prefill_nodes_hit(
    pd_pair: PD, proxy_url: str
) -> None:
    """``usage.prompt_tokens_details.cached_tokens`` through the proxy: P's prefix-cache
    hit (absent when none, as a colocated vLLM node answers), not what D held -- D
    computes no prompt token, P computes those it did not hit."""
    prompt = list(range(7, 7 + 5 * 16 + 3))  # five full blocks and three tokens

    def cached(url: str, salt: str, stream: bool = False) -> int | None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0,
                "cache_salt": salt, "stream": stream}  # fmt: skip
        if stream:
            body["stream_options"] = {"include_usage": True}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        if stream:
            lines = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: {")]
            usage = json.loads(lines[-1])["usage"]
        else:
            usage = resp.json()["usage"]
        details = usage.get("prompt_tokens_details")
        assert details is None or details["cached_tokens"] > 0, usage  # 0: absent (vLLM)
        return None if details is None else details["cached_tokens"]

    # The same prompt twice through the proxy: nothing cached, then P's five blocks.
    for stream in (False, True):
        salt = f"twice-{stream}"
        assert cached(proxy_url, salt, stream) is None
        assert cached(proxy_url, salt, stream) == 5 * 16
    # P holds the prompt (asked directly), D does not: P's hit.
    assert cached(pd_pair.p.url, "p-warm") is None
    assert cached(pd_pair.p.url, "p-warm") == 5 * 16  # what a colocated node reports
    assert cached(proxy_url, "p-warm") == 5 * 16
    assert cached(proxy_url, "p-warm", stream=True) == 5 * 16
    # D holds the prompt, P does not: P computed it all, nothing came from a cache.
    assert cached(pd_pair.d.url, "d-warm") is None
    assert cached(pd_pair.d.url, "d-warm") == 5 * 16
    assert cached(proxy_url, "d-warm") is None
