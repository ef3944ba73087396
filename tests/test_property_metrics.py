"""Property test (hypothesis): a node's ``/metrics`` agree with the work it served.

A node (``build_app`` over a real ``AsyncLLMEngine`` on the ``tiny`` model, CPU, in this
process; served by uvicorn on a loopback socket so a client can go away mid-stream) gets
drawn batches of concurrent requests: completions and chat, streamed or not, ``n``
choices (``best_of`` = ``n``), answers ended by their length, a stop string, a stop token
id or EOS (forced with ``logit_bias``), ``min_tokens``, prompts sharing prefixes
(prefix-cache hits), streams whose client disconnects after the first token (aborts) and
requests refused with a 400 (bad fields, a prompt past the context). The KV cache holds
a few requests only, so batches preempt.

After each batch, once the node is idle, the deltas of its metrics are what the answers
say (the counting rules are docs/deploy.md's "Token counters"):

- ``vllm:request_success_total{finished_reason}``: one per choice, by the choice's finish
  reason (a stop string's is ``stop``); a client gone is ``abort``; a 400 none. The
  HTTP layer's ``pdserve_request_finished_total`` agrees reason by reason.
- ``vllm:prompt_tokens_total``: each choice's whole prompt once (prefix-cache hits and
  preemptions do not change it), split by ``vllm:prompt_tokens_by_source_total``.
- ``vllm:generation_tokens_total`` (= ``pdserve_generation_tokens_total``): the tokens the
  engine sampled: the answers' tokens, exactly, unless a stop string or an abort left
  some unanswered (then at least those), = ``vllm:request_generation_tokens_sum`` = the
  first-token plus inter-token samples.
- every request-level histogram observed once per choice; token sums as the counters.
- idle: running, waiting, admitted and held 0, KV cache usage 0 (all three names).
- no counter, histogram count or sum ever decreases; ``pdserve_*`` twins equal ``vllm:*``.

The examples are fixed (``derandomize``, ``fakes.fixed_examples``);
``PDSERVE_METRICS_EXAMPLES=N`` multiplies their count for a local hunt.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fakes import example_scale, fixed_examples, hunt_timeout
from harness import wait_for
from hypothesis import event, given, note
from hypothesis import strategies as st
from hypothesis.control import current_build_context
from hypothesis.errors import InvalidArgument
from inproc_node import served, uni_config
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import AsyncLLMEngine
from engine.server.app import build_app

SCALE = example_scale("PDSERVE_METRICS_EXAMPLES")
MODEL = "tiny"
MAX_LEN = 128
BLOCK = 16
NUM_BLOCKS = 12  # 192 tokens: one request at its longest fits, a batch preempts
EOS = 257  # the byte tokenizer's
ABORT_MAX_TOKENS = MAX_LEN - 16  # an aborted stream's: far from its end when cut
REASONS = ("stop", "length", "abort")
# Prompts share these prefixes (a later one is a prefix-cache hit while its blocks stay).
PREFIXES = [list(range(1, 1 + 48)), list(range(60, 60 + 40))]
CHAT_TEXTS = ["Tell me a story about metrics.", "Tell me a story about metrics, and counters."]
BAD_FIELDS = {
    "temperature": -1.0,
    "n": 0,
    "max_tokens": -3,
    "best_of": 7,
    "top_p": 2.0,
}


# -- the node ---------------------------------------------------------------------------------


@dataclass
class Node:
    url: str
    engine: AsyncLLMEngine


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    cfg = uni_config(MODEL, max_model_len=MAX_LEN, num_blocks=NUM_BLOCKS, block_size=BLOCK)
    engine = AsyncLLMEngine(cfg, "WARNING")
    try:
        with served(build_app(engine, log_requests=False)) as url:
            yield Node(url, engine)
    finally:
        engine.shutdown()


# -- requests ---------------------------------------------------------------------------------


@dataclass
class Spec:
    chat: bool
    stream: bool
    n: int
    best_of: bool
    prompt: list[int]  # completions
    text: str  # chat
    max_tokens: int
    ending: str  # "length" | "stop_str" | "stop_ids" | "eos"
    min_tokens: int
    stop: list[str] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)
    abort: bool = False  # a stream whose client goes away after its first token
    bad: str | None = None  # a field made invalid (400), or "too_long"
    temperature: float = 1.0
    echo0: bool = False  # completions' echo without generation (``max_tokens`` 0)

    def body(self) -> dict[str, Any]:
        b: dict[str, Any] = {"model": MODEL, "max_tokens": self.max_tokens, "n": self.n}
        b["temperature"], b["seed"] = self.temperature, len(self.prompt) + self.max_tokens
        if self.chat:
            b["messages"] = [{"role": "user", "content": self.text}]
        else:
            b["prompt"] = self.prompt
            if self.best_of:
                b["best_of"] = self.n
        if self.echo0:  # the engine samples one token, the answer leaves it out
            b["echo"], b["max_tokens"] = True, 0
        if self.min_tokens:
            b["min_tokens"] = self.min_tokens
        if self.ending == "length":
            b["ignore_eos"] = True
        elif self.ending == "stop_str":
            b["stop"] = self.stop
        elif self.ending == "stop_ids":
            b["stop_token_ids"] = self.stop_ids
        elif self.ending == "eos":
            b["logit_bias"] = {str(EOS): 100}
        if self.stream:
            b["stream"] = True
            b["stream_options"] = {"include_usage": True}
        if self.bad == "too_long":
            b["prompt"] = list(range(1, MAX_LEN + 5))
            b.pop("messages", None)
        elif self.bad is not None:
            b[self.bad] = BAD_FIELDS[self.bad]
        return b

    @property
    def path(self) -> str:
        chat = self.chat and self.bad != "too_long"
        return "/v1/chat/completions" if chat else "/v1/completions"


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    chat = draw(st.booleans())
    prefix = draw(st.sampled_from(PREFIXES))
    cut = draw(st.integers(0, len(prefix)))
    tail = draw(st.lists(st.integers(100, 250), min_size=1 if cut == 0 else 0, max_size=8))
    spec = Spec(
        chat=chat,
        stream=draw(st.booleans()),
        n=draw(st.integers(1, 3)),
        best_of=False,
        prompt=prefix[:cut] + tail,
        text=draw(st.sampled_from(CHAT_TEXTS)),
        max_tokens=draw(st.integers(1, 24)),
        ending=draw(st.sampled_from(["length", "stop_str", "stop_ids", "eos"])),
        min_tokens=0,
    )
    spec.best_of = not chat and draw(st.booleans())
    spec.echo0 = not chat and draw(st.integers(0, 5)) == 0
    spec.min_tokens = draw(st.integers(0, 1 if spec.echo0 else spec.max_tokens))
    spec.stop = draw(st.lists(st.sampled_from(list("aeiou()[]{}<>!?~")), min_size=1, max_size=6))
    low = draw(st.integers(0, 200))
    spec.stop_ids = list(range(low, low + 64))
    what = draw(st.sampled_from(["ok"] * 6 + ["abort", "bad"]))
    if what == "abort":  # a completions stream of one choice, cut after its first token
        spec.chat, spec.stream, spec.n, spec.best_of = False, True, 1, False
        spec.max_tokens, spec.ending, spec.min_tokens = ABORT_MAX_TOKENS, "length", 0
        spec.echo0 = False
        spec.prompt = spec.prompt[:8]
        spec.abort = True
    elif what == "bad":
        spec.bad = draw(st.sampled_from([*BAD_FIELDS, "too_long"]))
    return spec


@dataclass
class Outcome:
    """What the client saw of one request."""

    status: int
    # Per choice: (finish reason, prompt tokens, completion tokens, a stop string hit).
    choices: list[tuple[str, int, int, bool]] = field(default_factory=list)
    aborted_prompt: int = 0  # an aborted stream's prompt tokens


def _choices_of(body: dict[str, Any], n: int) -> list[tuple[str, int, int, bool]]:
    usage = body["usage"]
    prompt = usage["prompt_tokens"]
    per = sorted(body["choices"], key=lambda c: c["index"])
    assert len(per) == n, body
    out = []
    for c in per:
        ids = c.get("token_ids")
        tokens = len(ids) if ids is not None else -1
        stop_str = c["finish_reason"] == "stop" and isinstance(c.get("stop_reason"), str)
        out.append((c["finish_reason"], prompt, tokens, stop_str))
    if any(t < 0 for _, _, t, _ in out):  # chat: the usage only (one choice, or their sum)
        if n == 1:
            out = [(r, p, usage["completion_tokens"], s) for r, p, _, s in out]
        else:
            out = [(r, p, -1, s) for r, p, _, s in out]
    return out


async def _send(client: httpx.AsyncClient, url: str, spec: Spec) -> tuple[Outcome, int]:
    """The request's outcome and the completion tokens its usage reports (-1: none)."""
    body = spec.body()
    if not spec.stream or spec.bad is not None:
        resp = await client.post(url + spec.path, json=body)
        if resp.status_code != 200:
            return Outcome(resp.status_code), -1
        data = resp.json()
        return Outcome(200, _choices_of(data, spec.n)), data["usage"]["completion_tokens"]
    async with client.stream("POST", url + spec.path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return Outcome(resp.status_code), -1
        finish: dict[int, tuple[str, bool]] = {}
        usage: dict[str, Any] | None = None
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if spec.abort:  # a token came: go away
                    assert c.get("finish_reason") is None, chunk
                    return Outcome(200, aborted_prompt=len(spec.prompt)), -1
                if c.get("finish_reason") is not None:
                    stop_str = c["finish_reason"] == "stop" and isinstance(
                        c.get("stop_reason"), str
                    )
                    finish[c["index"]] = (c["finish_reason"], stop_str)
    assert usage is not None and sorted(finish) == list(range(spec.n)), (finish, usage)
    prompt = usage["prompt_tokens"]
    choices = [(finish[i][0], prompt, -1, finish[i][1]) for i in range(spec.n)]
    return Outcome(200, choices), usage["completion_tokens"]


async def _send_all(url: str, batch: list[Spec]) -> list[tuple[Outcome, int]]:
    async with httpx.AsyncClient(timeout=120) as client:
        return list(await asyncio.gather(*(_send(client, url, s) for s in batch)))


# -- metrics ----------------------------------------------------------------------------------


# Labelled HTTP-level series, absent until their first sample.
LAZY = ("pdserve_request_finished_total", "pdserve_http_requests_total")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    text = httpx.get(url + "/metrics", timeout=30).text
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def val(m: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    found = [v for (n, ls), v in m.items() if n == name and set(labels.items()) <= set(ls)]
    assert found or labels or name in LAZY, f"no series {name}"
    return sum(found)


def monotone(before: Samples, after: Samples) -> None:
    """Counters, histogram counts, sums and buckets never decrease (or vanish)."""
    for key, v in before.items():
        name = key[0]
        if name.endswith(("_total", "_count", "_sum", "_bucket")):
            assert key in after, f"{key} vanished"
            assert after[key] >= v, f"{key} went down: {v} -> {after[key]}"


def check_idle(m: Samples) -> None:
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "pdserve_num_requests_running",
        "pdserve_num_requests_waiting", "pdserve_num_requests_admitted", "pdserve_engine_num_held",
        "pdserve_engine_num_waiting_for_remote_kv", "pdserve_kv_blocks_used",
        "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "pdserve_kv_cache_usage_ratio",
    ):  # fmt: skip
        assert val(m, name) == 0, (name, val(m, name))
    assert val(m, "pdserve_kv_blocks_free") == NUM_BLOCKS


def check_histograms(m: Samples) -> None:
    """Each histogram's ``+Inf`` bucket holds all its observations."""
    checked = 0
    for (name, labels), v in m.items():
        if name.endswith("_count"):
            family = name.removesuffix("_count")
            inf = m.get((family + "_bucket", tuple(sorted((*labels, ("le", "+Inf"))))))
            if inf is not None:  # a summary has none
                assert inf == v, (name, dict(labels), inf, v)
                checked += 1
    assert checked >= 10, checked  # vLLM's request histograms at least


def check_twins(m: Samples) -> None:
    """One quantity under two names agrees (the HTTP layer's and the engine's finish
    counts too: no request here fails or is cut before its first token)."""
    pairs = [
        ("pdserve_generation_tokens_total", "vllm:generation_tokens_total"),
        ("pdserve_engine_num_preemptions_total", "vllm:num_preemptions_total"),
        ("vllm:prompt_tokens_total", "vllm:prompt_tokens_by_source_total"),
        ("vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"),
    ]
    for a, b in pairs:
        assert val(m, a) == val(m, b), (a, val(m, a), b, val(m, b))
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert val(m, "vllm:prompt_tokens_by_source_total", source=source) == val(
            m, "pdserve_engine_prompt_tokens_by_source_total", source=source
        ), source
    for reason in REASONS:
        engine = val(m, "vllm:request_success_total", finished_reason=reason)
        http = val(m, "pdserve_request_finished_total", finish_reason=reason)
        assert engine == http, (reason, engine, http)


def _note_deltas(before: Samples, after: Samples) -> None:
    """The series that moved, in a falsifying example's report (inside an example)."""
    try:
        current_build_context()
    except InvalidArgument:
        return
    moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    note(f"deltas: { {k: v for k, v in moved.items() if not k[0].endswith('_bucket')} }")
    for name, labels in moved:  # what the example exercised
        if name in ("vllm:request_success_total", "pdserve_http_requests_total"):
            event(f"{name} {dict(labels)}")
        elif name in ("vllm:num_preemptions_total", "vllm:prompt_tokens_by_source_total"):
            event(f"{name} {dict(labels)} > 0")


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return val(after, name, **labels) - val(before, name, **labels)


def run_batch(node: Node, batch: list[Spec]) -> tuple[Samples, Samples]:
    """Serve ``batch`` at once, wait for the node to be idle, check the metrics' deltas."""
    before = scrape(node.url)
    results = asyncio.run(_send_all(node.url, batch))
    refused = [s for s, (o, _) in zip(batch, results, strict=True) if o.status != 200]
    for spec, (out, _) in zip(batch, results, strict=True):
        if spec.bad is not None:
            assert out.status == 400, (spec.bad, out.status)
        else:
            assert out.status == 200, (spec, out.status)
    aborted = [o for o, _ in results if o.status == 200 and not o.choices]
    answered = [(o, u) for o, u in results if o.choices]
    choices = [c for o, _ in answered for c in o.choices]
    n_engine = len(choices) + len(aborted)

    def finished(m: Samples) -> bool:
        done = delta(before, m, "vllm:request_success_total")
        http = delta(before, m, "pdserve_request_finished_total")
        return (
            done == n_engine and http == n_engine and val(m, "pdserve_num_requests_admitted") == 0
        )

    wait_for(lambda: finished(scrape(node.url)), 60, "every request to be counted as finished")
    after = scrape(node.url)
    _note_deltas(before, after)
    monotone(before, after)
    check_idle(after)
    check_twins(after)
    check_histograms(after)

    # Finish reasons: each choice's own; an aborted stream's "abort" (or, had it run out
    # before its client's disconnect was seen, its length).
    want = {r: sum(1 for c in choices if c[0] == r) for r in REASONS}
    got = {
        r: delta(before, after, "vllm:request_success_total", finished_reason=r) for r in REASONS
    }
    assert got["stop"] == want["stop"], (got, want)
    assert got["abort"] + got["length"] == len(aborted) + want["length"], (got, want)
    assert got["abort"] <= len(aborted), (got, want)

    # Prompt tokens: every choice's whole prompt, once.
    prompt = sum(c[1] for c in choices) + sum(o.aborted_prompt for o in aborted)
    assert delta(before, after, "vllm:prompt_tokens_total") == prompt
    assert delta(before, after, "vllm:prompt_tokens_by_source_total") == prompt
    assert delta(before, after, "pdserve_request_prompt_tokens_total") == prompt
    assert delta(before, after, "vllm:request_prompt_tokens_sum") == prompt
    # What this node computed: at least the prompts' local_compute part (a preemption
    # computes again).
    computed = delta(before, after, "pdserve_prompt_tokens_total")
    local = delta(before, after, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert computed >= local, (computed, local)

    # Generation tokens: the answers' (usage), exactly unless something went unanswered.
    answered_tokens = sum(u for _, u in answered)
    gen = delta(before, after, "vllm:generation_tokens_total")
    ttft = delta(before, after, "vllm:time_to_first_token_seconds_count")
    itl = delta(before, after, "vllm:inter_token_latency_seconds_count")
    assert gen == ttft + itl, (gen, ttft, itl)
    assert gen == delta(before, after, "vllm:request_generation_tokens_sum")
    assert ttft == n_engine
    # An echo without generation: one token each, the answer leaves it out.
    left_out = sum(s.n for s in batch if s.echo0 and s.bad is None)
    if aborted or any(c[3] for c in choices):  # what else went unanswered: at least 1 each
        assert gen >= answered_tokens + left_out + len(aborted), (gen, answered_tokens)
    else:
        assert gen == answered_tokens + left_out, (gen, answered_tokens, left_out)
    http_tokens = delta(before, after, "pdserve_request_completion_tokens_total")
    if aborted:  # what the node got of an aborted stream: its first token at least
        assert answered_tokens + len(aborted) <= http_tokens <= gen, (http_tokens, gen)
    else:
        assert http_tokens == answered_tokens, (http_tokens, answered_tokens)
    for name in (
        "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count", "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count", "pdserve_request_latency_seconds_count",
        "pdserve_time_to_first_token_seconds_count",
    ):  # fmt: skip
        assert delta(before, after, name) == n_engine, name
    # Refused requests: 400s on the HTTP counter, nothing in the engine's.
    assert delta(before, after, "pdserve_http_requests_total", status="400") == len(refused)
    return before, after


batches = st.lists(specs(), min_size=1, max_size=5)


@hunt_timeout(SCALE)
@given(batch=batches)
@fixed_examples(25 * SCALE)
def test_metrics_agree_with_the_work_served(node: Node, batch: list[Spec]) -> None:
    for s in batch:
        note(repr(s))
    run_batch(node, batch)


def test_preemptions_are_counted_and_change_no_token_count(node: Node) -> None:
    """A batch whose choices need far more KV than the node has: requests are preempted
    (and recomputed), yet each prompt and each token counts once."""
    long = Spec(
        chat=False, stream=False, n=3, best_of=False, prompt=PREFIXES[0], text="",
        max_tokens=40, ending="length", min_tokens=0,
    )  # fmt: skip
    before, after = run_batch(node, [long, Spec(**{**long.__dict__, "prompt": PREFIXES[1]})])
    assert delta(before, after, "vllm:num_preemptions_total") > 0
    assert delta(before, after, "vllm:generation_tokens_total") == 2 * 3 * 40


def finish_reasons(node: Node, spec: Spec) -> dict[str, float]:
    """``vllm:request_success_total``'s growth by finish reason over one request."""
    before, after = run_batch(node, [spec])
    return {
        r: delta(before, after, "vllm:request_success_total", finished_reason=r) for r in REASONS
    }


def test_a_stop_string_counts_as_stop(node: Node) -> None:
    """An answer ended by a stop string is ``finished_reason="stop"`` in
    ``vllm:request_success_total`` (vLLM's: its output processor finishes the request with
    STOP), as in the answer and in ``pdserve_request_finished_total`` -- not the abort the
    node sends the engine to end it."""
    body = {"model": MODEL, "prompt": PREFIXES[0], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    text = httpx.post(node.url + "/v1/completions", json=body, timeout=60).json()
    # A printable character well inside the answer: a stop string hit before its end.
    chars = [ch for ch in text["choices"][0]["text"][1:-4] if ch.isascii() and ch.isprintable()]
    assert chars, text
    for stream in (False, True):
        spec = Spec(
            chat=False, stream=stream, n=1, best_of=False, prompt=PREFIXES[0], text="",
            max_tokens=24, ending="stop_str", min_tokens=0, stop=[chars[0]], temperature=0,
        )  # fmt: skip
        reasons = finish_reasons(node, spec)
        assert reasons == {"stop": 1, "length": 0, "abort": 0}, (stream, reasons)


def test_a_stop_string_with_the_last_token_counts_as_stop(node: Node) -> None:
    """An answer whose stop string came with the token that ended it anyway (here its
    ``max_tokens``-th) is a "stop" in the answer, and so in ``vllm:request_success_total``
    (vLLM's output processor decides the reason), not the engine's "length"."""
    for seed in range(400):  # a sampled answer whose last token is a new ASCII character
        body = {"model": MODEL, "prompt": PREFIXES[1], "max_tokens": 4 + seed % 20,
                "temperature": 1, "seed": seed, "ignore_eos": True}  # fmt: skip
        ids = httpx.post(node.url + "/v1/completions", json=body, timeout=60).json()
        ids = ids["choices"][0]["token_ids"]
        if 33 <= ids[-1] < 127 and ids[-1] not in ids[:-1]:
            break
    else:
        raise AssertionError("no answer ends with a new ASCII character")
    for stream in (False, True):
        spec = Spec(
            chat=False, stream=stream, n=1, best_of=False, prompt=PREFIXES[1], text="",
            max_tokens=body["max_tokens"], ending="stop_str", min_tokens=0, stop=[chr(ids[-1])],
        )  # fmt: skip
        spec.body = lambda spec=spec: {**Spec.body(spec), "seed": seed}  # type: ignore[method-assign]
        reasons = finish_reasons(node, spec)
        assert reasons == {"stop": 1, "length": 0, "abort": 0}, (stream, reasons)


def test_an_echo_without_generation_counts_as_its_answer(node: Node) -> None:
    """``echo`` with ``max_tokens`` 0: the engine samples one token the answer leaves out,
    and the answer ends by its "length" (docs/api.md) -- also when that token is EOS, a
    stop token id or holds a stop string. The finish counts so, and the token as one
    generated."""
    base = Spec(
        chat=False, stream=False, n=1, best_of=False, prompt=PREFIXES[0][:5], text="",
        max_tokens=1, ending="eos", min_tokens=0, echo0=True,
    )  # fmt: skip
    stop_ids = Spec(**{**base.__dict__, "ending": "stop_ids", "stop_ids": list(range(512))})
    for spec in (base, stop_ids, Spec(**{**base.__dict__, "stream": True})):
        before, after = run_batch(node, [spec])
        reasons = {
            r: delta(before, after, "vllm:request_success_total", finished_reason=r)
            for r in REASONS
        }
        assert reasons == {"stop": 0, "length": 1, "abort": 0}, (spec, reasons)
        assert delta(before, after, "vllm:generation_tokens_total") == 1
