"""The chaos suite's workload and set-up, in process (no node started): its structured
outputs are requests a node takes, their checks accept what a grammar allows and nothing
else, and the extra node flags reach every node (the reference too, unless
``plain_reference``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from chaos_cluster import Cluster
from chaos_config import STRUCTURED, STRUCTURED_CHECKS, ChaosConfig, public_config
from chaos_workload import Result, body_of, check_answer, make_prompts, make_specs

from engine.server.chat_protocol import parse_chat_request
from engine.server.protocol import parse_completion_request
from engine.server.request_checks import check_structured

# Complete answers of each shape (what greedy ``tiny`` answers, in two cases), and answers
# that break it.
GOOD = ("qzqzqz", "q" * 40, "blue sky over the lake", '{"c":"blue","ok":false}')
BAD = ("qzqzq1", "q" * 39 + "Q", "blue sky over the sea", '{"c":"pink","ok":false}')


@pytest.mark.parametrize("i", range(len(STRUCTURED)))
def test_every_structured_shape_is_a_valid_request(i):
    pytest.importorskip("llguidance")
    spec = make_specs(ChaosConfig(), random.Random(0), 1, 0, 1, 3)[0]
    spec.structured = i
    prompts = make_prompts(3, random.Random(0))
    for chat in (False, True):
        spec.chat = chat
        body = body_of(spec, prompts)
        req = parse_chat_request(body) if chat else parse_completion_request(body)
        assert req.structured_output is not None
        check_structured(req.structured_output)  # compiles


@pytest.mark.parametrize("i", range(len(STRUCTURED)))
def test_the_checks_take_what_the_grammar_allows_and_nothing_else(i):
    check, good, bad = STRUCTURED_CHECKS[i], GOOD[i], BAD[i]
    assert check(good, True)
    assert all(check(good[:k], False) for k in range(len(good) + 1))  # cut by max_tokens
    assert not check(bad, True)
    if i < 3:  # a JSON prefix is only checked for its start
        assert not check(bad, False)
    if len(good) > 1:
        assert not check(good[:-1], True)  # the grammar did not end there


def test_a_completed_answer_breaking_its_grammar_is_wrong_even_when_the_reference_agrees():
    r = Result(0, 1, "x", False, False, 12, 5, None, outcome="completed", finish="stop")
    r.ref_key, r.ids, r.text = (0, False, 12, 0), [113, 49], "q1"
    check_answer(r, ([113, 49], "q1"))
    assert r.wrong and "breaks its structured output" in (r.wrong_detail or "")
    ok = Result(0, 1, "x", False, False, 12, 5, None, outcome="completed", finish="stop")
    ok.ref_key, ok.ids, ok.text = (0, False, 12, 0), list(b"qzqzqz"), "qzqzqz"
    check_answer(ok, (list(b"qzqzqz"), "qzqzqz"))
    assert not ok.wrong


def test_a_plain_workload_draws_what_it_drew_before_structured_outputs():
    """``structured_rate`` 0 draws nothing more: a seed's workload stays what it was."""
    specs = make_specs(ChaosConfig(), random.Random(0), 1, 0, 200, 24)
    assert all(s.structured == -1 for s in specs)
    mixed = make_specs(ChaosConfig(structured_rate=0.5), random.Random(0), 1, 0, 200, 24)
    assert {s.structured for s in mixed} == {-1, *range(len(STRUCTURED))}


@pytest.mark.parametrize("plain", [False, True])
def test_node_flags_and_environment_reach_every_node(tmp_path: Path, plain: bool):
    cfg = ChaosConfig(
        node_args=("--async-scheduling", "--num-blocks", "200"),
        node_env={"PDSERVE_DEFER_READBACK": "1"},
        plain_reference=plain,
    )
    cluster = Cluster(cfg, tmp_path)
    for n in cluster.nodes:
        cmd = n.command()
        assert "--async-scheduling" in cmd and n.env is not None, n.name
        assert n.env["PDSERVE_DEFER_READBACK"] == "1" and n.env["PDSERVE_KV_SECRET"]
        # The extra flags come after the suite's own: a repeated flag overrides.
        assert cmd[len(cmd) - 1 - cmd[::-1].index("--num-blocks") + 1] == "200"
    ref = cluster.reference
    assert ("--async-scheduling" in ref.command()) is not plain
    assert ("--no-async-scheduling" in ref.command()) is plain  # a synchronous reference
    assert ((ref.env or {}).get("PDSERVE_DEFER_READBACK") == "1") is not plain
    assert "PDSERVE_KV_SECRET" not in (ref.env or {})


def test_the_summary_hides_secrets_passed_in_node_flags_or_environment():
    """``--node-env HF_TOKEN=...`` or ``--node-arg=--api-key=...`` reached the JSON summary
    (only the side-channel secret was hidden): a summary is meant to be shared."""
    cfg = ChaosConfig(
        node_args=("--api-key", "sk-flag", "--api-key=sk-eq", "--num-blocks", "200"),
        node_env={"HF_TOKEN": "hf_abc", "PDSERVE_API_KEY": "k", "PDSERVE_DEFER_READBACK": "1"},
    )
    shown = public_config(cfg)
    text = repr(shown)
    for secret in ("sk-flag", "sk-eq", "hf_abc", "'k'", cfg.kv_secret):
        assert secret not in text, secret
    assert shown["node_args"] == [
        "--api-key",
        "<hidden>",
        "--api-key=<hidden>",
        "--num-blocks",
        "200",
    ]
    assert shown["node_env"] == {
        "HF_TOKEN": "<hidden>",
        "PDSERVE_API_KEY": "<hidden>",
        "PDSERVE_DEFER_READBACK": "1",
    }


def test_a_responses_share_asks_chats_as_the_responses_api_and_checks_their_text():
    from chaos_responses import ResponsesStream, body_outcome
    from chaos_workload import path_of

    from engine.responses_api.request import to_chat

    cfg = ChaosConfig(responses_rate=1.0, structured_rate=0.5)
    specs = make_specs(cfg, random.Random(0), 1, 0, 40, 6)
    asked = [s for s in specs if s.responses]
    # Every chat of the workload but those with a structured output the Responses API
    # cannot spell (regexes, a choice): those stay chats.
    assert asked and all(s.chat for s in asked)
    assert all(s.structured < 0 or "response_format" in STRUCTURED[s.structured] for s in asked)
    assert any(s.structured >= 0 for s in asked)
    prompts = make_prompts(6, random.Random(1))
    for spec in asked:
        assert path_of(spec) == "/v1/responses"
        chat, _ = to_chat(body_of(spec, prompts))  # what a node serves it as
        parse_chat_request(chat)
        assert chat["messages"] == [{"role": "user", "content": prompts[spec.prompt]}]
        assert spec.ref_key == (spec.prompt, True, spec.max_tokens, spec.structured)
    # Read back: a body, and a stream whose deltas must add up to its final response.
    done = {"object": "response", "status": "incomplete",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "ab"}]}]}  # fmt: skip
    assert body_outcome(done) == ("completed", "length", "ab")
    assert body_outcome({"object": "response", "status": "failed"})[0] == "errored"
    stream = ResponsesStream()
    for ev in ({"type": "response.created"}, {"type": "response.output_text.delta", "delta": "ab"},
               {"type": "response.incomplete", "response": done}):  # fmt: skip
        assert stream.feed(json.dumps(ev)) is None
    assert (stream.ended, stream.finish, stream.text, stream.final_text) == (
        True,
        "length",
        "ab",
        "ab",
    )
    assert stream.feed("[DONE]") is not None  # no [DONE] on this API
    # Checked by text against the chat reference.
    r = Result(0, 1, "x", True, False, 4, 1, None, outcome="completed", text="ab", responses=True)
    check_answer(r, ([1, 2], "ab"))
    assert not r.wrong
    r.text = "ac"
    check_answer(r, ([1, 2], "ab"))
    assert r.wrong


def test_tenants_salt_and_key_every_request_and_draw_nothing_without_them():
    from engine.responses_api.request import to_chat

    plain = make_specs(ChaosConfig(), random.Random(0), 1, 0, 100, 24)
    assert all(s.tenant == -1 and s.salt is None and s.cache_key is None for s in plain)
    prompts = make_prompts(24, random.Random(1))
    assert all(
        set(body_of(s, prompts)) & {"cache_salt", "prompt_cache_key"} == set() for s in plain
    )
    cfg = ChaosConfig(tenants=3, responses_rate=0.2)
    specs = make_specs(cfg, random.Random(0), 1, 0, 200, 24)
    assert {s.tenant for s in specs} == {0, 1, 2}
    salts = {s.tenant: s.salt for s in specs}
    assert len(set(salts.values())) == 3 and all(
        s.salt == salts[s.tenant] and s.cache_key.startswith(f"t{s.tenant}-") for s in specs
    )
    # The tenants send the same prompts (long ones after a shared prefix): unsalted, they
    # would share prefix-cache blocks.
    by_prompt: dict[int, set[int]] = {}
    for s in specs:
        by_prompt.setdefault(s.prompt, set()).add(s.tenant)
    assert any(len(t) > 1 for p, t in by_prompt.items() if p % 3 == 2)
    # One conversation per shared prefix: long prompts after one prefix share a key.
    long_keys = {(s.tenant, s.prompt): s.cache_key for s in specs if s.prompt % 3 == 2}
    assert len(set(long_keys.values())) < len(long_keys)
    for s in specs:
        body = body_of(s, prompts)
        assert body["cache_salt"] == s.salt and body["prompt_cache_key"] == s.cache_key
        if s.responses:
            body, _ = to_chat(body)
        req = parse_chat_request(body) if s.chat else parse_completion_request(body)
        assert (req.cache_salt, req.prompt_cache_key) == (s.salt, s.cache_key)
        if s.stream and not s.responses:  # the usage (cached tokens) in the last chunk
            assert body["stream_options"] == {"include_usage": True}
    # The negative control: same tenants and keys, no salt.
    unsalted = make_specs(
        ChaosConfig(tenants=3, tenant_unsalted=True), random.Random(0), 1, 0, 5, 24
    )
    assert all(s.salt is None and "cache_salt" not in body_of(s, prompts) for s in unsalted)


def _answer(tenant: int, prompt: int, t: tuple[float, float], cached: int | None, n: int) -> Result:
    r = Result(0, 1, f"t{tenant}", False, False, 4, 1, None, outcome="completed", tenant=tenant)
    r.ref_key, r.t_start, r.t_end, r.cached, r.prompt_tokens = (prompt, False, 4, -1), *t, cached, n
    return r


def test_the_isolation_check_fails_a_hit_only_another_tenant_could_have_left():
    from chaos_workload import check_isolation

    shared = list(range(40))
    tokens = {(0, False): shared + [1000, 1001], (1, False): shared + [2000], (2, False): [7] * 50}
    a = _answer(0, 0, (0.0, 1.0), 0, 42)  # tenant 0 sends prefix P first
    b = _answer(1, 1, (2.0, 3.0), 32, 41)  # tenant 1's first of P: a hit of tenant 0's
    figures = check_isolation([a, b], tokens, 16)
    assert len(figures["violations"]) == 1 and b.isolation and not a.isolation
    assert "share at most 0 (another tenant's 32)" in b.isolation
    assert figures["exposed"] == 1 and figures["hits"] == 1
    # Not counted: the same without the hit; a later request of tenant 1 hitting its own
    # earlier one; one hitting a same-tenant request still running (sent before it ended).
    b.cached, b.isolation = 0, None
    c = _answer(1, 0, (4.0, 5.0), 32, 42)
    d = _answer(2, 2, (6.0, 7.5), 48, 50)
    e = _answer(2, 2, (7.0, 8.0), 48, 50)
    figures = check_isolation([a, b, c, d, e], tokens, 16)
    assert figures["violations"] == [] and figures["exposed"] == 1, figures
    # A hit larger than the blocks its tenant shares: 48 of a 32-token block prefix.
    c.cached = 48
    assert len(check_isolation([a, b, c], tokens, 16)["violations"]) == 1
    # A request the proxy retried may hit its own earlier attempt's blocks (the prefill
    # node it went to again, a decode node that recomputed the prompt when the KV did not
    # come): its own prompt counts as sent before it (so such a request is not checked).
    b.cached = 32
    figures = check_isolation([a, b], tokens, 16, retried={"t1"})
    assert figures["violations"] == [] and figures["retried"] == 1 and figures["exposed"] == 0
    # The check's own tokenization must be the node's (else its bound is another prompt's).
    a.prompt_tokens = 43
    assert "tokenization" in check_isolation([a], tokens, 16)["violations"][0]


def test_a_tenant_answer_without_its_usage_is_broken():
    from chaos_workload import _read_usage

    r = Result(0, 1, "x", True, True, 4, 1, None, outcome="completed", tenant=0)
    _read_usage(r, None)  # a stream asked with include_usage that sent no usage chunk
    assert r.outcome == "broken"
    r = Result(0, 1, "x", True, False, 4, 1, None, outcome="completed", tenant=0, responses=True)
    _read_usage(r, {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}})
    assert (r.outcome, r.cached, r.prompt_tokens) == ("completed", 32, 40)
    r = Result(0, 1, "x", False, False, 4, 1, None, outcome="completed", tenant=0)
    _read_usage(r, {"prompt_tokens": 40})  # no details: nothing cached (vLLM's rule)
    assert (r.cached, r.prompt_tokens) == (0, 40)


def test_retried_labels_are_read_from_the_proxy_log(tmp_path: Path):
    from chaos_report import retried_labels

    (tmp_path / "proxy-1.err").write_text(
        "INFO proxy.session: request chaos-r1-3: chat via prefill http://a + decode "
        "http://b (attempt 1, transfer chaos-r1-3-aa)\n"
        "INFO proxy.session: request chaos-r1-4: completions via prefill http://a + decode "
        "http://b (attempt 1, transfer chaos-r1-4-aa)\n"
        "INFO proxy.session: request chaos-r1-4: completions on decode http://b alone, "
        "prompt ~40 tokens, ~0 cached there (attempt 2, transfer chaos-r1-4-bb)\n"
        "INFO proxy.session: request dup-1: chat via prefill http://a + decode http://b "
        "(attempt 12, transfer dup-1-cc)\n"
    )
    (tmp_path / "p1.1-1.err").write_text("request chaos-r1-5: x (attempt 2, transfer t)\n")
    assert retried_labels(tmp_path) == {"chaos-r1-4", "dup-1"}
