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
