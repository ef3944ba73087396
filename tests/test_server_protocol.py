"""Unit tests of OpenAI request parsing/validation and stop-string matching (no engine)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.server.chat_protocol import parse_chat_request
from engine.server.field_parsers import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from engine.server.json_body import parse_json_body
from engine.server.protocol import parse_completion_request
from engine.server.request_checks import check_model, check_token_ids, resolve_max_tokens
from engine.server.request_fields import APIError, error_body
from engine.server.stop_strings import StopStringMatcher
from kvconnector.params import KVTransferParams


def _err(fn: Any, body: Any) -> APIError:
    with pytest.raises(APIError) as info:
        fn(body)
    return info.value


# -- completions ---------------------------------------------------------------------------


def test_completion_defaults() -> None:
    req = parse_completion_request({"model": "m", "prompt": "hello"})
    assert req.prompt_text == "hello" and req.prompt_token_ids is None
    assert req.max_tokens == 16
    assert (req.temperature, req.top_p, req.top_k, req.seed) == (1.0, 1.0, -1, None)
    assert req.stop == [] and req.stop_token_ids == [] and not req.ignore_eos
    assert not req.stream and not req.include_usage and req.kv_transfer_params is None


def test_completion_all_fields() -> None:
    body = {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 5,
        "seed": 42,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["\n", "END"],
        "stop_token_ids": [9],
        "ignore_eos": True,
        "n": 1,
        "echo": False,
        "logprobs": None,
        "user": "someone",
        "kv_transfer_params": {"do_remote_decode": True},
        "some_future_field": 1,  # unknown fields are ignored (and named in the log)
    }
    req = parse_completion_request(body)
    assert req.ignored_fields == ("some_future_field",)
    assert req.prompt_token_ids == [1, 2, 3] and req.prompt_text is None
    assert req.max_tokens == 7 and req.temperature == 0.0 and req.top_p == 0.5
    assert req.top_k == 5 and req.seed == 42 and req.stream and req.include_usage
    assert req.stop == ["\n", "END"] and req.stop_token_ids == [9] and req.ignore_eos
    assert req.kv_transfer_params == KVTransferParams(do_remote_decode=True)
    sp = req.sampling_params(7)
    assert sp.max_tokens == 7 and sp.greedy and sp.top_k == 5 and sp.seed == 42
    assert sp.stop_token_ids == [9] and sp.ignore_eos


@pytest.mark.parametrize(
    "prompt, text, ids",
    [
        ("abc", "abc", None),
        (["abc"], "abc", None),
        ([[4, 5]], None, [4, 5]),
        ([4, 5], None, [4, 5]),
    ],
)
def test_prompt_forms(prompt: Any, text: str | None, ids: list[int] | None) -> None:
    req = parse_completion_request({"prompt": prompt})
    assert req.prompt_text == text and req.prompt_token_ids == ids


def test_stop_string_single() -> None:
    assert parse_completion_request({"prompt": "x", "stop": "END"}).stop == ["END"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt[1]"),  # each prompt of a batch is checked
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "abc"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "top_k": "5"}, "top_k"),
        ({"prompt": "x", "seed": "1"}, "seed"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"prompt": "x", "stop": ["a", 3]}, "stop"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "x", "stop_token_ids": "1"}, "stop_token_ids"),
        ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "stream": True, "stream_options": []}, "stream_options"),
        (
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),
        ({"prompt": "x", "top_k": 1e308}, "top_k"),
        ({"prompt": "x", "max_tokens": 2**63}, "max_tokens"),
        ({"prompt": "x", "temperature": 10**400}, "temperature"),
        ({"prompt": "x", "top_p": -(10**400)}, "top_p"),
        ({"prompt": "x", "kv_transfer_params": "x"}, "kv_transfer_params"),
        ({"prompt": "x", "model": 3}, "model"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 129}, "n"),  # MAX_CHOICES (tests/test_choices.py: the rest)
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),  # past --max-logprobs: the node's 400
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "min_tokens": 17}, "min_tokens"),  # > the default max_tokens 16
        ({"prompt": "x", "suffix": "s"}, "suffix"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": -2.01}, "frequency_penalty"),
        ({"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "repetition_penalty": 1e7}, "repetition_penalty"),
        # A positive logit divided by it would overflow to inf (NaN probabilities).
        ({"prompt": "x", "repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"prompt": "x", "logit_bias": 0}, "logit_bias"),  # was accepted (falsy)
        ({"prompt": "x", "logit_bias": []}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"a": 5}}, "logit_bias"),  # keys are token ids
        ({"prompt": "x", "logit_bias": {"-1": 5}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"1.5": 5}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"1": "5"}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"1": None}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"1": 10**400}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"9" * 30: 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "min_p": -0.1}, "min_p"),
        ({"prompt": "x", "min_p": "0.1"}, "min_p"),
        ({"prompt": "x", "allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"prompt": "x", "allowed_token_ids": [1, "2"]}, "allowed_token_ids"),
        ({"prompt": "x", "allowed_token_ids": [1.5]}, "allowed_token_ids"),
        ({"prompt": "x", "allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"prompt": "x", "allowed_token_ids": 5}, "allowed_token_ids"),
        ({"prompt": "x", "allowed_token_ids": {"5": 1}}, "allowed_token_ids"),
        ({"prompt": "x", "allowed_token_ids": [0] * 16_385}, "allowed_token_ids"),
    ],
)
def test_completion_rejects(body: dict[str, Any], param: str) -> None:
    e = _err(parse_completion_request, body)
    assert e.status_code == 400
    assert e.param == param
    assert param in e.message
    err = e.body()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


@pytest.mark.parametrize("body", [[], "x", 5, None])
def test_body_must_be_object(body: Any) -> None:
    assert _err(parse_completion_request, body).status_code == 400
    assert _err(parse_chat_request, body).status_code == 400


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": "x", "max_tokens": ' + b"9" * 4301 + b"}", "max_tokens"),
        (b'{"prompt": [1, -' + b"9" * 100_000 + b"]}", "prompt[1]"),
        (b"9" * 5000, None),
    ],
    ids=["max_tokens", "prompt[1]", "body"],
)
def test_an_integer_literal_past_the_digit_limit_is_a_400_naming_it(raw: bytes, param) -> None:
    """Python will not convert integers of more than 4300 digits (a ValueError, a 500 before)."""
    e = _err(parse_json_body, raw)
    assert (e.status_code, e.param, e.code) == (400, param, "invalid_number")


def test_top_k_zero_means_disabled() -> None:
    assert parse_completion_request({"prompt": "x", "top_k": 0}).top_k == -1


def test_integral_float_accepted_for_int() -> None:
    assert parse_completion_request({"prompt": "x", "max_tokens": 8.0}).max_tokens == 8


# -- chat ----------------------------------------------------------------------------------


def test_chat_parsing() -> None:
    req = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "developer", "content": "dev"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
            "max_completion_tokens": 9,
            "max_tokens": 100,
            "response_format": {"type": "text"},
            "logprobs": False,
            "tool_choice": "none",
        }
    )
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "dev"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]
    assert req.max_tokens == 9  # max_completion_tokens wins


def test_chat_max_tokens_default_none() -> None:
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})
    assert req.max_tokens is None
    assert (
        parse_chat_request(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        ).max_tokens
        == 3
    )


_MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content[0].text",
        ),
        ({"messages": _MSG, "max_tokens": 0}, "max_tokens"),
        ({"messages": _MSG, "max_completion_tokens": -3}, "max_completion_tokens"),
        ({"messages": _MSG, "temperature": "hot"}, "temperature"),
        ({"messages": _MSG, "n": -1}, "n"),
        ({"messages": _MSG, "logprobs": "yes"}, "logprobs"),
        ({"messages": _MSG, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"messages": _MSG, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"messages": _MSG, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": _MSG, "tool_choice": "auto"}, "tool_choice"),
        ({"messages": _MSG, "response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}, *_MSG]},
            "messages[0].tool_calls[0].function",
        ),
        # The older form of the same: it was dropped, the model saw an empty turn.
        (
            {"messages": [{"role": "assistant", "function_call": {"name": "f"}}, *_MSG]},
            "messages[0].function_call",
        ),
    ],
)
def test_chat_rejects(body: dict[str, Any], param: str) -> None:
    e = _err(parse_chat_request, body)
    assert e.status_code == 400 and e.param == param and param in e.message


# -- engine-dependent checks ---------------------------------------------------------------


def test_check_model() -> None:
    check_model(None, "tiny")
    check_model("tiny", "tiny")
    with pytest.raises(APIError) as info:
        check_model("gpt-4", "tiny")
    e = info.value
    assert e.status_code == 400 and e.param == "model" and e.code == "model_not_found"
    assert "gpt-4" in e.message


def test_check_token_ids() -> None:
    check_token_ids([0, 511], 512)
    with pytest.raises(APIError) as info:
        check_token_ids([1, 512], 512)
    assert info.value.param == "prompt" and "512" in info.value.message


def test_resolve_max_tokens() -> None:
    assert resolve_max_tokens(10, 5, 100) == 10
    assert resolve_max_tokens(95, 5, 100) == 95
    assert resolve_max_tokens(None, 30, 100, "messages") == 70
    with pytest.raises(APIError) as info:
        resolve_max_tokens(96, 5, 100)
    e = info.value
    assert e.param == "max_tokens" and e.code == "context_length_exceeded"
    assert e.message.startswith("This model's maximum context length is 100 tokens.")
    assert "requested 101 tokens (5 in the prompt, 96 for the completion)" in e.message
    with pytest.raises(APIError) as info:
        resolve_max_tokens(1, 100, 100)
    assert info.value.param == "prompt"
    with pytest.raises(APIError) as info:
        resolve_max_tokens(None, 120, 100, "messages")
    assert info.value.param == "messages" and "120 in the messages" in info.value.message
    with pytest.raises(APIError):
        resolve_max_tokens(5, 0, 100)


def test_error_body_shape() -> None:
    assert error_body("m", param="p") == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "p", "code": None}
    }


# -- stop strings --------------------------------------------------------------------------


def _feed_all(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    out = []
    for i, p in enumerate(pieces):
        text, hit = m.feed(p, final=i == len(pieces) - 1)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out), False


def test_stop_no_stops_passthrough() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)


def test_stop_within_one_piece() -> None:
    assert _feed_all(["END"], ["helloENDworld"]) == ("hello", True)


def test_stop_across_pieces_and_holdback() -> None:
    m = StopStringMatcher(["END"])
    assert m.feed("abcE") == ("abc", False)  # "E" may start "END": held back
    assert m.feed("N") == ("", False)
    assert m.feed("Dxyz") == ("", True)


def test_stop_false_start_released() -> None:
    m = StopStringMatcher(["END"])
    assert m.feed("abE") == ("ab", False)
    assert m.feed("x") == ("Ex", False)


def test_stop_final_flushes_held_text() -> None:
    assert _feed_all(["END"], ["abc", "EN"]) == ("abcEN", False)


def test_of_several_stops_in_one_piece_the_first_listed_is_the_one() -> None:
    """vLLM's ``check_stop_strings``: the stop strings in the request's order, the first
    found in the new text (with its look-back) wins, not the first in the text."""
    m = StopStringMatcher(["world", "lo"])
    assert m.feed("hello world", final=True) == ("hello ", True) and m.matched == "world"
    m = StopStringMatcher(["lo", "world"])
    assert m.feed("hello world", final=True) == ("hel", True) and m.matched == "lo"
    m = StopStringMatcher(["b", "abc"], include=True)
    assert m.feed("xab") == ("xab", True) and m.matched == "b"
    assert _feed_all(["\n"], ["line1", "\nline2"]) == ("line1", True)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


# -- stop lists: bounded (one request set the pace of every request on its node) ----------


def test_stop_token_ids_past_the_cap_is_a_400_naming_it() -> None:
    ok = parse_completion_request(
        {"prompt": "x", "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))}
    )
    assert len(ok.stop_token_ids) == MAX_STOP_TOKEN_IDS
    for fn, base in ((parse_completion_request, {"prompt": "x"}), (parse_chat_request, CHAT)):
        e = _err(fn, {**base, "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)})
        assert e.status_code == 400 and e.param == "stop_token_ids"
        assert str(MAX_STOP_TOKEN_IDS) in e.message


@pytest.mark.parametrize(
    "stop",
    [
        ["s"] * (MAX_STOP_STRINGS + 1),
        ["x" * (MAX_STOP_CHARS + 1)],
        ["y" * (MAX_STOP_CHARS // 2)] * 2 + ["z"],
    ],
)
def test_stop_strings_past_the_caps_are_a_400_naming_stop(stop: list[str]) -> None:
    for fn, base in ((parse_completion_request, {"prompt": "x"}), (parse_chat_request, CHAT)):
        e = _err(fn, {**base, "stop": stop})
        assert e.status_code == 400 and e.param == "stop", e.message


def test_stop_strings_at_the_caps_are_accepted() -> None:
    stop = ["a" * (MAX_STOP_CHARS // MAX_STOP_STRINGS)] * MAX_STOP_STRINGS
    assert parse_completion_request({"prompt": "x", "stop": stop}).stop == stop


def _naive_hold(buf: str, stops: list[str]) -> int:
    """The longest suffix of ``buf`` that begins some stop string (the definition)."""
    longest = max(len(s) for s in stops) - 1
    for k in range(min(longest, len(buf)), 0, -1):
        if any(s.startswith(buf[-k:]) for s in stops):
            return k
    return 0


def test_the_stop_matcher_holds_back_exactly_the_text_that_may_begin_a_stop() -> None:
    import random

    rng = random.Random(5)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 4))]  # fmt: skip
        pieces = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 4))) for _ in range(6)]
        m, text, out = StopStringMatcher(stops), "", ""
        for piece in pieces:
            old, text = len(text), text + piece
            emitted, hit = m.feed(piece)
            out += emitted
            # vLLM's check_stop_strings: the first listed stop that ends in the new text.
            found = ((s, text.find(s, max(0, old - len(s) + 1))) for s in stops if piece)
            first = next(((s, i) for s, i in found if i >= 0), None)
            if first is not None:
                assert hit and out == text[: first[1]] and m.matched == first[0], (stops, pieces)
                break
            assert not hit and out == text[: len(text) - _naive_hold(text, stops)], (stops, pieces)


def test_the_json_check_still_names_a_bad_item_among_plain_ones() -> None:
    """Lists of plain values (token ids) skip the per-item walk; anything else in them is
    still checked and named."""
    raw = b'{"prompt": [1, 2.5, true, null, "\\ud800"]}'
    e = _err(parse_json_body, raw)
    assert (e.status_code, e.param, e.code) == (400, "prompt[4]", "invalid_unicode")
    assert parse_json_body(b'{"prompt": [1, 2, 3]}') == {"prompt": [1, 2, 3]}


def test_the_json_depth_limit_counts_the_items_of_a_list_of_plain_values() -> None:
    from engine.server.json_body import MAX_JSON_DEPTH

    def nested(levels: int) -> bytes:  # the object is level 0, its list level 1, ...
        return b'{"prompt": ' + b"[" * levels + b"1" + b"]" * levels + b"}"

    assert parse_json_body(nested(MAX_JSON_DEPTH - 1))
    e = _err(parse_json_body, nested(MAX_JSON_DEPTH))
    assert (e.status_code, e.code) == (400, "invalid_json") and "nested" in e.message


def test_logit_bias_and_min_p_reach_the_sampling_params() -> None:
    # OpenAI's logit_bias: token ids as JSON keys, biases clamped to [-100, 100] (vLLM).
    body = {"prompt": "x", "logit_bias": {"5": 2.5, "7": -1000, "9": 300}, "min_p": 0.05}
    sp = parse_completion_request(body).sampling_params(16)
    assert sp.logit_bias == {5: 2.5, 7: -100.0, 9: 100.0} and sp.min_p == 0.05
    chat = parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
                               "logit_bias": {"3": 1}, "min_p": 0})  # fmt: skip
    assert chat.sampling_params(4).logit_bias == {3: 1.0} and chat.ignored_fields == ()
    plain = parse_completion_request({"prompt": "x", "logit_bias": {}, "min_p": None})
    assert plain.sampling_params(16).logit_bias == {} and plain.sampling_params(16).min_p == 0.0
    assert MAX_LOGIT_BIAS == 1024


def test_penalties_reach_the_sampling_params() -> None:
    body = {"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1,
            "repetition_penalty": 1.2}  # fmt: skip
    sp = parse_completion_request(body).sampling_params(16)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.2)
    assert sp.has_penalties
    plain = parse_completion_request({"prompt": "x", "presence_penalty": 0}).sampling_params(16)
    assert not plain.has_penalties


def test_allowed_token_ids_reach_the_sampling_params_up_to_the_bound() -> None:
    body = {"prompt": "x", "allowed_token_ids": [5, 3, 5, 0]}
    assert parse_completion_request(body).sampling_params(16).allowed_token_ids == [5, 3, 5, 0]
    chat = parse_chat_request({**CHAT, "allowed_token_ids": [7]})
    assert chat.sampling_params(4).allowed_token_ids == [7] and chat.ignored_fields == ()
    for off in (None, []):  # null or empty: every token (today's neutral value)
        plain = parse_completion_request({"prompt": "x", "allowed_token_ids": off})
        assert plain.sampling_params(16).allowed_token_ids is None
    for bad in ([-1], [1, "2"], [True], {"5": 1}):  # a type error, no longer "not supported"
        e = _err(parse_completion_request, {"prompt": "x", "allowed_token_ids": bad})
        assert (e.param, e.code) == ("allowed_token_ids", "invalid_type"), e.message
    full = list(range(16_384))  # the bound
    sp = parse_completion_request({"prompt": "x", "allowed_token_ids": full}).sampling_params(16)
    assert sp.allowed_token_ids == full
    for fn, base in ((parse_completion_request, {"prompt": "x"}), (parse_chat_request, CHAT)):
        e = _err(fn, {**base, "allowed_token_ids": [*full, 0]})
        assert e.status_code == 400 and e.param == "allowed_token_ids" and "16384" in e.message


@pytest.mark.parametrize("temperature", [3.5e38, 1e39, 1e308, 10**300])
def test_a_temperature_past_float32s_range_is_a_400_naming_it(temperature: float) -> None:
    """The sampler divides float32 logits by the temperature: past float32's largest value
    it is infinite there, a masked logit (-inf / inf) is NaN, and the draw picked token 0
    whatever ``allowed_token_ids`` or ``min_tokens`` said (found by tests/test_fuzz_http.py:
    ``allowed_token_ids: [65, 66]`` at ``temperature: 1e39`` answered ``[0, 0, ...]``)."""
    for fn, base in ((parse_completion_request, {"prompt": "x"}), (parse_chat_request, CHAT)):
        e = _err(fn, {**base, "temperature": temperature})
        assert (e.status_code, e.param) == (400, "temperature"), e.message
    with pytest.raises(InvalidRequestError) as info:  # the offline API's entry too
        SamplingParams(temperature=float(temperature))
    assert info.value.param == "temperature"
    # The largest value float32 holds is still a temperature (uniform over what is left).
    assert parse_completion_request({"prompt": "x", "temperature": 3.4e38}).temperature == 3.4e38


@pytest.mark.parametrize(
    "extra, echoed",
    [
        ({"add_generation_prompt": False}, "So far"),  # the final message's role answers
        ({"continue_final_message": True, "add_generation_prompt": False}, "So far"),
        ({}, "So far"),  # an assistant message last, the answer the assistant's
        ({"echo": False}, ""),
    ],
)
def test_chat_echo_is_the_final_message_in_the_answers_role(extra, echoed) -> None:
    messages = [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": "So far"}]
    req = parse_chat_request({"messages": messages, "echo": True, **extra})
    assert req.chat_echo == echoed
    user_last = parse_chat_request({"messages": messages[:1], "echo": True})
    assert user_last.chat_echo == ""  # the answer is the assistant's, the last the user's


@pytest.mark.parametrize("choice", ["required", "auto", "none"])
def test_chat_echo_with_an_answer_parsed_into_tool_calls_is_taken(choice: str) -> None:
    # vLLM's: the echo leads the content, calls or not (their places count it: jobs.py).
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "So far"}]
    body = {"messages": messages, "tools": [tool], "echo": True, "tool_choice": choice}
    assert parse_chat_request(body).chat_echo == "So far"


@pytest.mark.parametrize("value", [True, False, None])
def test_spaces_between_special_tokens_is_accepted_as_the_detokenizer_is(value) -> None:
    # pdserve's detokenizers (bytes; tokenizers' fast decode) never put spaces between
    # special tokens: that is `false`, and vLLM's fast-tokenizer detokenizer ignores the
    # field too. A bool is accepted; anything else is a 400 naming it.
    parse_completion_request({"prompt": "x", "spaces_between_special_tokens": value})
    with pytest.raises(APIError) as e:
        parse_completion_request({"prompt": "x", "spaces_between_special_tokens": "no"})
    assert e.value.param == "spaces_between_special_tokens"


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"": "\\ud800"}', ""),  # an empty field name is a field, not the body
        (b'{"": {"a": "\\ud800"}}', ".a"),
        (b'{"\\ud800": 1}', "body"),  # a top-level key: the body is what holds it
        (b'["\\ud800"]', "[0]"),
    ],
)
def test_a_lone_surrogate_is_refused_naming_where_it_is(raw: bytes, param: str) -> None:
    e = _err(parse_json_body, raw)
    assert (e.status_code, e.param, e.code) == (400, param, "invalid_unicode")
    assert f"'{param}' holds an invalid Unicode character" in e.message
