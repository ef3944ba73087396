"""What stopped an answer, in its text and its ``stop_reason`` (vLLM's rules), without a node.

A token that stopped the answer (a ``stop_token_ids`` entry, or EOS) stays in ``token_ids``
but its text is left out, unless ``include_stop_str_in_output``; ``stop_reason`` is the stop
string, the stop token id, or null (EOS, length). ``generate_steps`` runs against a fake
engine that hands back scripted outputs; the byte tokenizer makes ids readable (72 = "H").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine.outputs import RequestOutput, TokenLogprob
from engine.server.chat_protocol import parse_chat_request
from engine.server.jobs import Job, Step, generate_steps
from engine.server.logprobs import TokenStrings
from engine.server.protocol import parse_completion_request
from engine.tokenizer import ByteTokenizer, IncrementalDetokenizer
from kvconnector.params import KVTransferParams
from proxy.client_stream import ClientStream
from proxy.validation import validate_request

EOS = ByteTokenizer.EOS
PROMPT = list(b"The capital of France is")


class FakeEngine:
    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs
        self.aborted: list[str] = []

    async def generate(self, request_id: str, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        for out in self.outputs:
            yield out

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        self.aborted.append(request_id)

    async def settle(self, request_id: str, stop_string: bool) -> None:
        return None


def _out(ids: list[int], finish: str | None = None, logprobs: bool = False) -> RequestOutput:
    lps = [TokenLogprob(t, -1.0) for t in ids] if logprobs else None
    return RequestOutput("r", list(ids), finish is not None, finish, new_logprobs=lps)  # type: ignore[arg-type]


def _job(body: dict[str, Any], chat: bool = False) -> Job:
    body = {"max_tokens": 8, **body}
    if chat:
        req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **body})
    else:
        req = parse_completion_request({"prompt": "The capital of France is", **body})
    strings = TokenStrings(ByteTokenizer()) if req.logprobs is not None else None
    return Job(chat, "r", "r", "tiny", PROMPT, req.sampling_params(8), req, strings=strings)


def _steps(job: Job, outputs: list[RequestOutput]) -> list[Step]:
    detok = IncrementalDetokenizer(ByteTokenizer(), prompt_ids=job.prompt_ids)

    async def run() -> list[Step]:
        return [s async for s in generate_steps(FakeEngine(outputs), job, detok)]  # type: ignore[arg-type]

    return asyncio.run(run())


def _text(steps: list[Step]) -> str:
    return "".join(s.text for s in steps)


def _ids(steps: list[Step]) -> list[int]:
    return [t for s in steps for t in s.token_ids]


@pytest.mark.parametrize(
    "outputs",
    [
        [_out([72, 105]), _out([91], "stop")],  # the stop token alone in the last output
        [_out([72, 105, 91], "stop")],  # with others
    ],
)
def test_a_stop_token_id_is_in_the_ids_not_in_the_text(outputs: list[RequestOutput]) -> None:
    steps = _steps(_job({"stop_token_ids": [91]}), outputs)
    assert _text(steps) == "Hi"
    assert _ids(steps) == [72, 105, 91]
    assert steps[-1].finish_reason == "stop" and steps[-1].stop_reason == 91


def test_the_audit_case_a_first_token_that_stops_leaves_no_text() -> None:
    steps = _steps(_job({"stop_token_ids": [91]}), [_out([91], "stop")])
    assert _text(steps) == "" and _ids(steps) == [91] and steps[-1].stop_reason == 91


def test_include_stop_str_in_output_keeps_the_stop_tokens_text() -> None:
    job = _job({"stop_token_ids": [91], "include_stop_str_in_output": True})
    steps = _steps(job, [_out([72, 105]), _out([91], "stop")])
    assert _text(steps) == "Hi[" and steps[-1].stop_reason == 91


def test_eos_has_no_text_and_no_stop_reason() -> None:
    steps = _steps(_job({}), [_out([72, 105, EOS], "stop")])
    assert _text(steps) == "Hi" and _ids(steps) == [72, 105, EOS]
    assert steps[-1].finish_reason == "stop" and steps[-1].stop_reason is None


def test_eos_named_in_stop_token_ids_with_ignore_eos_is_the_stop_reason() -> None:
    job = _job({"stop_token_ids": [EOS], "ignore_eos": True})
    assert _steps(job, [_out([72, EOS], "stop")])[-1].stop_reason == EOS


def test_length_has_all_the_text_and_no_stop_reason() -> None:
    steps = _steps(_job({"stop_token_ids": [1]}), [_out([72, 105, 91], "length")])
    assert _text(steps) == "Hi[" and steps[-1].stop_reason is None


def test_a_stop_string_is_the_stop_reason() -> None:
    steps = _steps(_job({"stop": ["zz", "i["]}), [_out([72, 105]), _out([91, 33])])
    assert _text(steps) == "H" and steps[-1].finish_reason == "stop"
    assert steps[-1].stop_reason == "i["
    job = _job({"stop": ["zz", "i["], "include_stop_str_in_output": True})
    steps = _steps(job, [_out([72, 105]), _out([91, 33])])
    assert _text(steps) == "Hi[" and steps[-1].stop_reason == "i["


def test_the_stop_string_completed_first_is_the_stop_reason_whatever_the_outputs_carry() -> None:
    """vLLM looks for stop strings in each step's new text (one token's): the one that
    completes first, token by token, ends the answer -- also when an output carries several
    tokens (merged for a slow reader): "H" with "i", not "Hi" with "[" (listed first), nor
    "" with "Hi[" (which starts first in the text, but ends after "i" did)."""
    for stops in (["[", "i"], ["Hi[", "i"]):
        steps = _steps(_job({"stop": stops}), [_out([72, 105, 91])])
        assert _text(steps) == "H" and steps[-1].stop_reason == "i", (stops, steps)


@pytest.mark.parametrize(
    "stops, text, reason",
    [
        (["i", "Hi"], "H", "i"),  # "i" is listed first: the text ends before it
        (["Hi", "i"], "", "Hi"),
        (["zz", "i", "Hi"], "H", "i"),
    ],
)
def test_of_stop_strings_one_token_completes_the_first_listed_is_the_stop_reason(
    stops: list[str], text: str, reason: str
) -> None:
    """vLLM's rule (``vllm/v1/engine/detokenizer.py``, ``check_stop_strings``): the stop
    strings are tried in the request's order on the text a step added (with a look-back
    of ``len(stop) - 1``); the first one found ends the answer and cuts the text, wherever
    another one starts. Tokens H i X: "i" completes both "i" and "Hi". The same
    streamed (one output a token), in one output, and on a decode leg that skips P's
    first token (its text is the colocated one's less "H", the client's)."""
    ids = list(b"HiXa")
    for outputs in ([_out([t]) for t in ids], [_out(ids)]):
        steps = _steps(_job({"stop": stops}), outputs)
        assert (_text(steps), steps[-1].finish_reason) == (text, "stop"), (stops, steps)
        assert steps[-1].stop_reason == reason, (stops, steps)
        kept = _steps(_job({"stop": stops, "include_stop_str_in_output": True}), outputs)
        assert _text(kept) == "Hi" and kept[-1].stop_reason == reason, (stops, kept)
        # The client has "H": nothing more of the text (the colocated one is "H" or "").
        d = _steps(_skip_first(_job({"stop": stops})), outputs)
        assert _text(d) == "" and d[-1].stop_reason == reason, (stops, d)


def test_a_stop_string_is_looked_for_without_the_stop_tokens_text() -> None:
    # "i[" would match with the stop token's text; vLLM checks the text without it.
    job = _job({"stop": ["i["], "stop_token_ids": [91]})
    steps = _steps(job, [_out([72, 105]), _out([91], "stop")])
    assert _text(steps) == "Hi" and steps[-1].stop_reason == 91


def test_a_decode_leg_that_skips_a_first_token_which_stops_sends_nothing() -> None:
    job = _job({"stop_token_ids": [91]})
    job.req.kv_transfer_params = KVTransferParams(
        do_remote_prefill=True,
        remote_side_channel="tcp://127.0.0.1:1",
        transfer_id="t",
        skip_first_token=True,
    )
    steps = _steps(job, [_out([91], "stop")])
    assert _text(steps) == "" and _ids(steps) == [] and steps[-1].stop_reason == 91


def test_logprobs_keep_the_stop_tokens_entry() -> None:
    job = _job({"stop_token_ids": [91], "logprobs": 0})
    steps = _steps(job, [_out([72, 105, 91], "stop", logprobs=True)])
    body = job.response(_text(steps), _ids(steps), steps[-1], steps[-1].logprobs)
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "i", "["] and len(lp["token_logprobs"]) == 3
    assert body["choices"][0]["text"] == "Hi"


@pytest.mark.parametrize("chat", [False, True])
def test_every_choice_carries_stop_reason(chat: bool) -> None:
    job = _job({"stop_token_ids": [91]}, chat=chat)
    steps = _steps(job, [_out([72]), _out([105, 91], "stop")])
    chunks = [job.chunk(Step("", []), first=True)] if chat else []
    chunks += [job.chunk(s) for s in steps]
    assert [c["choices"][0]["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [91]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    body = job.response(_text(steps), _ids(steps), steps[-1])
    choice = body["choices"][0]
    assert choice["stop_reason"] == 91 and choice["token_ids"] == [72, 105, 91]
    assert (choice["message"]["content"] if chat else choice["text"]) == "Hi"


@pytest.mark.parametrize("chat", [False, True])
def test_the_proxy_passes_stop_reason_through(chat: bool) -> None:
    body: dict[str, Any] = {"model": "tiny", "stream": True, "stop_token_ids": [91]}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    req = validate_request("chat" if chat else "completions", json.dumps(body).encode(), [], None)
    stream = ClientStream(req, "r", 0, node_skips_first=False)
    job = _job({"stop_token_ids": [91]}, chat=chat)
    p_answer = job.response("H", [72], Step("H", [72], "length"))
    events = [
        json.loads(e[len("data: ") :]) for e in stream.first_chunk(p_answer).split("\n\n") if e
    ]
    assert all(e["choices"][0]["stop_reason"] is None for e in events)  # chat: role, token
    stream.decode_starts()
    last = job.chunk(Step("i", [72, 105, 91], "stop", stop_reason=91))
    out = stream.rewrite(last)
    assert out is not None and out["choices"][0]["stop_reason"] == 91
    assert out["choices"][0]["token_ids"] == [105, 91]


# -- found by a review ---------------------------------------------------------------------


def _skip_first(job: Job) -> Job:
    job.req.kv_transfer_params = KVTransferParams(
        do_remote_prefill=True, remote_side_channel="tcp://127.0.0.1:1", transfer_id="t",
        skip_first_token=True,
    )  # fmt: skip
    return job


def test_min_tokens_counts_stop_strings_token_by_token_whatever_the_outputs_carry() -> None:
    """``min_tokens`` 2, stop "H", tokens H i ! H H: the first H is within min_tokens, the
    fourth token stops the answer -- "Hi!" whether the engine's outputs carry one id each
    or all five (merged for a slow reader: the whole output's text was searched, "")."""
    body = {"stop": ["H"], "min_tokens": 2}
    ids = list(b"Hi!HH")
    one = _steps(_job(body), [_out(ids, "length")])
    each = _steps(_job(body), [_out([t]) for t in ids[:-1]] + [_out(ids[-1:], "length")])
    assert _text(one) == _text(each) == "Hi!", (_text(one), _text(each))
    assert one[-1].stop_reason == each[-1].stop_reason == "H"


def test_a_stop_string_may_start_within_min_tokens_and_end_after_them() -> None:
    """vLLM's look-back: ``min_tokens`` 2, stop "iX", tokens H i X a: "i" is within
    min_tokens, "X" after -- the answer is "H" (whether the outputs carry one id each or
    all of them), and a stream held the "i" back; "Hi" ends within min_tokens: no match."""
    ids = list(b"HiXa")
    for body, want, reason in (
        ({"stop": ["iX"], "min_tokens": 2}, "H", "iX"),
        ({"stop": ["iX"], "min_tokens": 2, "include_stop_str_in_output": True}, "HiX", "iX"),
        ({"stop": ["Hi"], "min_tokens": 2}, "HiXa", None),
    ):
        one = _steps(_job(body), [_out(ids, "length")])
        each = _steps(_job(body), [_out([t]) for t in ids[:-1]] + [_out(ids[-1:], "length")])
        assert _text(one) == _text(each) == want, (body, _text(one), _text(each))
        assert one[-1].stop_reason == each[-1].stop_reason == reason
        if reason == "iX":  # "i", within min_tokens, may begin "iX": held back
            assert [s.text for s in each[:2]] == ["H", ""], each


def test_a_decode_leg_whose_skipped_first_token_is_the_stop_token_shows_nothing() -> None:
    """D drops P's first token (``skip_first_token``) and that token, an incomplete UTF-8
    byte listed in stop_token_ids, stopped the answer: no text (its byte was flushed as
    U+FFFD)."""
    job = _skip_first(_job({"stop_token_ids": [0xE2]}))
    steps = _steps(job, [_out([0xE2], "stop")])
    assert _text(steps) == "" and steps[-1].stop_reason == 0xE2, steps


def test_with_node_skip_first_token_a_first_token_inside_a_character_is_not_doubled() -> None:
    """P's first token is the first byte of "é" (its text U+FFFD); D took it as context and
    sends the whole "é" with the next token: the client gets "é!" (it got U+FFFD + "é!")."""
    p = _job({})
    p_steps = _steps(p, [_out([0xC3], "length")])
    p_answer = p.response(_text(p_steps), _ids(p_steps), p_steps[-1])
    d = _skip_first(_job({}))
    d_steps = _steps(d, [_out([0xC3]), _out([0xA9]), _out([33], "length")])
    body = json.dumps({"prompt": "x", "stream": True}).encode()
    cs = ClientStream(validate_request("/v1/completions", body, [], None), "r", 0, True)
    first = json.loads(cs.first_chunk(p_answer)[6:])["choices"][0]["text"]
    cs.decode_starts()
    rest = [cs.rewrite(d.chunk(s)) for s in d_steps]
    assert first + "".join(r["choices"][0]["text"] for r in rest if r) == "\u00e9!"


def test_a_decode_leg_finds_a_stop_string_that_begins_in_the_skipped_first_token() -> None:
    """D drops P's first token (the client has it: with ``--node-skip-first-token``, a
    stream pre-streamed by P -- never with stop strings -- or a decode re-opened after the
    client got tokens) but a stop string may begin in its text: stop "Hi", tokens H i X.
    Colocated, the answer stops at "i" ("" before the stop); D stops there too, sending
    nothing (the client's "H" came before), rather than running on past the stop string
    as "iX..."."""
    body = {"stop": ["Hi", "zz"], "max_tokens": 8}
    ids = list(b"HiXa")
    colocated = _steps(_job(body), [_out([t]) for t in ids])
    assert _text(colocated) == "" and colocated[-1].stop_reason == "Hi"
    for outputs in ([_out([t]) for t in ids], [_out(ids)]):
        d = _steps(_skip_first(_job(body)), outputs)
        assert _text(d) == "" and d[-1].finish_reason == "stop", d
        assert d[-1].stop_reason == "Hi" and _ids(d)[0] == ord("i"), d
    # Where the stop string begins after the first token, D's text is the colocated one's
    # less that token's: "H" + "i" == "Hi" before "X!".
    body = {"stop": ["X!"], "max_tokens": 8}
    ids = list(b"HiX!a")
    colocated = _steps(_job(body), [_out([t]) for t in ids])
    d = _steps(_skip_first(_job(body)), [_out([t]) for t in ids])
    assert _text(colocated) == "H" + _text(d) == "Hi" and d[-1].stop_reason == "X!"
    # The first token's text may only begin a stop string that never comes: it is not
    # sent again ("H" is the client's), the rest of the answer is.
    body = {"stop": ["Hz"], "max_tokens": 4}
    d = _steps(_skip_first(_job(body)), [_out([t]) for t in b"Hi!"] + [_out([33], "length")])
    assert _text(d) == "i!!" and d[-1].finish_reason == "length", d


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_strings_answer_is_the_same_whatever_the_outputs_carry(include: bool) -> None:
    """An output may carry several tokens (merged for a slow reader; async scheduling): a
    stop string completed within it ends the answer's ids, log probabilities and usage at
    the token that completed it, as when every token came alone -- not at whatever else
    the output carried (the answer would depend on the reader's speed)."""
    body = {"stop": ["i["], "include_stop_str_in_output": include, "logprobs": 1}
    alone = [_out([72], logprobs=True), _out([105], logprobs=True), _out([91], logprobs=True)]
    merged = [_out([72, 105, 91, 33, 34], logprobs=True)]
    answers = []
    for outputs in (alone, merged):
        job = _job(body)
        steps = _steps(job, outputs)
        lps = [e.token_id for s in steps for e in (s.logprobs or [])]
        answers.append((_text(steps), _ids(steps), lps, job.completion_tokens))
    assert answers[0] == answers[1]
    assert answers[1][1] == [72, 105, 91] and answers[1][3] == 3
