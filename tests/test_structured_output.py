"""Structured outputs (constrained decoding with llguidance): every spelling of the request
field parsed into one ``StructuredOutput``, checked where the request enters (a bad grammar,
a missing package, two at once: a 400 naming the field), the grammar's mask applied by the
sampler, the matcher advanced by the scheduler (a grammar's end ends the request), and
P/D answering as a colocated node does.

The ``tiny`` model's tokenizer is bytes (ids 0-255, BOS 256, EOS 257; the model's 512
logits): every text is reachable, so regexes, choices and JSON all work; a random model
fills strings and numbers with whatever it likes, so the schemas here bound them (enums,
``maxLength``).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from harness import MODEL, PD, Proc, Procs, metric, sse_events, stop, wait_healthy

from engine.sampling_params import InvalidRequestError
from engine.server.chat_protocol import parse_chat_request
from engine.server.protocol import parse_completion_request
from engine.server.request_checks import check_structured
from engine.server.request_fields import APIError
from engine.structured.compiler import GrammarCompiler
from engine.structured.matcher import GrammarState, fill_bitmask
from engine.structured.spec import MAX_GUIDED_CHOICES, MAX_SPEC_BYTES, StructuredOutput
from engine.tokenizer import ByteTokenizer

pytest.importorskip("llguidance")

_MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "color", "ok"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}"
TINY_VOCAB = 512


def _check_schema(text: str) -> None:
    """``text`` is JSON matching ``SCHEMA`` (checked by hand: no jsonschema dependency)."""
    value = json.loads(text)
    assert set(value) == {"name", "color", "ok"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["ok"], bool)


def _compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer, TINY_VOCAB)


# -- parsing: every spelling, one object -------------------------------------------------------


@pytest.mark.parametrize(
    "fields, kind, param",
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         "json", "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": SCHEMA}}, "json", "structured_outputs.json"),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json", "structured_outputs.json"),
        ({"structured_outputs": {"regex": REGEX}}, "regex", "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": 'start: "x"'}}, "grammar", "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs.json_object"),
        ({"guided_json": SCHEMA}, "json", "guided_json"),
        ({"guided_regex": REGEX}, "regex", "guided_regex"),
        ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
        ({"guided_grammar": 'start: "x"'}, "grammar", "guided_grammar"),
    ],
)  # fmt: skip
def test_every_spelling_parses_into_one_structured_output(
    fields: dict[str, Any], kind: str, param: str
) -> None:
    for req in (
        parse_completion_request({"prompt": "x", **fields}),
        parse_chat_request({"messages": _MSG, **fields}),
    ):
        so = req.structured_output
        assert so is not None and so.kind == kind and so.param == param
        assert req.sampling_params(8).structured_output is so
        check_structured(so)  # a valid grammar
    # A schema given as text or as an object is one cache key.
    a = parse_completion_request({"prompt": "x", "guided_json": SCHEMA}).structured_output
    b = parse_completion_request({"prompt": "x", "guided_json": json.dumps(SCHEMA)})
    assert a == b.structured_output and a is not None and a.key == b.structured_output.key  # type: ignore[union-attr]


def test_neutral_values_ask_for_nothing() -> None:
    for fields in (
        {"response_format": {"type": "text"}},
        {"response_format": None},
        {"structured_outputs": {}},
        {"guided_json": None, "guided_choice": []},
    ):
        assert parse_completion_request({"prompt": "x", **fields}).structured_output is None
        assert parse_completion_request({"prompt": "x", **fields}).ignored_fields == ()


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),  # two at once
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"backend": "xgrammar"}}, "structured_outputs.backend"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": 5}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_choice": ["x"] * (MAX_GUIDED_CHOICES + 1)}, "guided_choice"),
        ({"guided_regex": "a" * (MAX_SPEC_BYTES + 1)}, "guided_regex"),
        ({"guided_json": {"enum": ["x" * MAX_SPEC_BYTES]}}, "guided_json"),
        # Nested deeper than JSON's parser goes, as a string (a body is capped at 64 levels).
        ({"guided_json": '{"items":' * 5000 + "{}" + "}" * 5000}, "guided_json"),
    ],
)  # fmt: skip
def test_bad_shapes_are_400s_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion_request({"prompt": "x", **fields})
    assert e.value.status_code == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize("kind", ["regex", "grammar", "choice", "json"])
@pytest.mark.parametrize("value", [0, 0.0])
def test_a_zero_in_structured_outputs_is_that_kinds_bad_value_not_an_absent_key(
    kind: str, value: float
) -> None:
    # 0 == False in Python: a membership test against (None, False) read a 0 as an
    # absent key ("must set exactly one ..., got none"); the 400 names the key's value.
    with pytest.raises(APIError) as e:
        parse_completion_request({"prompt": "x", "structured_outputs": {kind: value}})
    assert e.value.status_code == 400
    assert e.value.param == f"structured_outputs.{kind}", e.value.message


@pytest.mark.parametrize(
    "make",
    [
        lambda: StructuredOutput.regex("a\ud800", "regex"),
        lambda: StructuredOutput.choice(["ok", "\udfff"], "regex"),
        lambda: StructuredOutput.json_schema({"enum": ["\ud800"]}, "regex"),
    ],
)
def test_a_lone_surrogate_in_an_offline_spec_is_an_invalid_request_naming_it(make: Any) -> None:
    # The HTTP body parser refuses lone surrogates; the offline API (LLM) reached the size
    # check's encode and raised a bare UnicodeEncodeError naming no field.
    with pytest.raises(InvalidRequestError, match="surrogate") as e:
        make()
    assert e.value.param == "regex"


@pytest.mark.parametrize("key", ["backend", "disable_any_whitespace", "whitespace_pattern"])
def test_a_vllm_structured_outputs_key_not_implemented_is_an_unsupported_parameter(
    key: str,
) -> None:
    # As every field vLLM knows and pdserve does not implement (docs/api.md: code
    # "unsupported_parameter" with param naming it); it was a 400 with code null.
    with pytest.raises(APIError) as e:
        parse_completion_request({"prompt": "x", "structured_outputs": {"regex": "a", key: "v"}})
    assert e.value.param == f"structured_outputs.{key}"
    assert e.value.code == "unsupported_parameter", e.value.message


@pytest.mark.parametrize(
    "fields, param, reason",
    [
        ({"guided_json": {"type": "strin"}}, "guided_json", "strin"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
         "response_format.json_schema.schema", "nope"),
        ({"guided_regex": "[0-9"}, "guided_regex", "unclosed character class"),
        ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "foo"),
    ],
)  # fmt: skip
def test_a_grammar_that_does_not_compile_is_a_400_with_the_librarys_reason(
    fields: dict[str, Any], param: str, reason: str
) -> None:
    so = parse_completion_request({"prompt": "x", **fields}).structured_output
    assert so is not None
    with pytest.raises(APIError) as e:
        check_structured(so)
    assert e.value.status_code == 400 and e.value.param == param
    assert param in e.value.message and reason in e.value.message, e.value.message


def test_hostile_grammars_compile_in_bounded_time_or_are_refused() -> None:
    """Pathological regexes and a deep schema: a 400 or a compiled grammar, quickly."""
    compiler = _compiler()
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(60):  # what a body's 64 levels allow
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    hostile = [StructuredOutput.json_schema(deep, "guided_json")] + [
        StructuredOutput.regex(rx, "guided_regex")
        for rx in ("(a{1000}){1000}", "(x+x+)+y", "((((a*)*)*)*)*b", "(.*a){40}", "[a-z]{60000}")
    ]
    for so in hostile:
        t0 = time.monotonic()
        try:
            check_structured(so)
            compiler.compile(so)
        except APIError as e:
            assert e.param == so.param
        except ValueError as e:  # InvalidRequestError from the compile: a 400 at the node
            assert getattr(e, "param", None) == so.param
        assert time.monotonic() - t0 < 10, so.spec[:40]


def test_without_llguidance_a_structured_request_is_a_400_saying_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)  # ``import llguidance`` fails
    so = parse_chat_request({"messages": _MSG, "guided_regex": "a+"}).structured_output
    assert so is not None  # parsing needs no package
    with pytest.raises(APIError) as e:
        check_structured(so)
    assert e.value.status_code == 400 and e.value.param == "guided_regex"
    assert "pip install 'pdserve[structured]'" in e.value.message
    assert parse_chat_request({"messages": _MSG}).structured_output is None  # nothing else


# -- compiler, matcher, bitmask ---------------------------------------------------------------


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_matcher() -> None:
    compiler = _compiler()
    so = StructuredOutput.regex(REGEX)
    template = compiler.compile(so)
    assert compiler.compile(StructuredOutput.regex(REGEX, "guided_regex")) is template
    one, two = compiler.new_matcher(so), compiler.new_matcher(so)
    assert one is not two and one is not template
    assert GrammarState(one).accept(ord("1"))
    assert compiler.compile(so) is template and compiler.num_cached == 1


def test_the_engine_thread_never_compiles_a_grammar_the_http_layer_compiled() -> None:
    # The HTTP layer compiles in a thread and hands the request its matcher; a burst of
    # other grammars evicting it from the cache before the request reaches the scheduler
    # must not make the engine thread compile it again (~100 ms for a large schema, every
    # running request's steps waiting).
    from engine.config import EngineConfig
    from engine.core.request import Request
    from engine.core.scheduler import Scheduler
    from engine.sampling_params import SamplingParams
    from kvconnector.noop import NoopConnectorScheduler

    compiler = GrammarCompiler(ByteTokenizer, TINY_VOCAB, cache_size=1)
    so = StructuredOutput.regex(REGEX)
    given = GrammarState(compiler.compile(so).deep_copy())  # what the HTTP layer made
    compiler.compile(StructuredOutput.regex("[a-z]{4}"))  # evicts it
    calls = []
    compiler.compile = lambda so: calls.append(so)  # type: ignore[method-assign]
    cfg = EngineConfig()
    sched = Scheduler(cfg, 64, 512, NoopConnectorScheduler(cfg, None), compiler)  # type: ignore[arg-type]
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4, structured_output=so))
    req.grammar = given
    sched.add_request(req)
    assert calls == [] and req.grammar is given


def _allowed(buf: np.ndarray, k: int, j: int) -> list[int]:
    words = (TINY_VOCAB + 31) // 32
    row = buf[j * words : (j + 1) * words].view(np.uint32)
    return [t for t in range(TINY_VOCAB) if (int(row[t // 32]) >> (t % 32)) & 1]


def test_the_bitmask_allows_what_the_grammar_allows_next_and_names_its_rows() -> None:
    compiler = _compiler()
    regex = GrammarState(compiler.new_matcher(StructuredOutput.regex(REGEX)))
    choice = GrammarState(compiler.new_matcher(StructuredOutput.choice(["yes", "no"])))
    for t in b"12":
        assert regex.accept(t)
    buf = fill_bitmask([(3, regex), (0, choice)], TINY_VOCAB)
    assert list(buf[-2:]) == [3, 0]  # the sampling rows they belong to
    assert _allowed(buf, 2, 0) == list(range(ord("0"), ord("9") + 1))
    assert _allowed(buf, 2, 1) == [ord("n"), ord("y")]
    for t in b"3-ab":
        assert regex.accept(t)
    # Complete: nothing but EOS may follow, and the answer ends with it (vLLM's way).
    assert not regex.finished and _allowed(fill_bitmask([(0, regex)], TINY_VOCAB), 1, 0) == [
        ByteTokenizer.EOS
    ]
    # A prefill node's first token is checked with ``allows``: EOS, and nothing else.
    assert regex.allows(ByteTokenizer.EOS) and not regex.allows(ord("c"))
    assert regex.accept(ByteTokenizer.EOS) and regex.finished
    assert not regex.accept(ord("c")) and regex.error


def _walk(state: GrammarState, vocab: int, seed: int, limit: int = 200) -> list[int]:
    """Tokens a random sampler under the grammar's mask picks until it is finished."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while not state.finished and len(out) < limit:
        buf = fill_bitmask([(0, state)], vocab)
        row = buf[: (vocab + 31) // 32].view(np.uint32)
        allowed = [t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1]
        assert allowed, state.error
        out.append(int(rng.choice(allowed)))
        assert state.accept(out[-1]), state.error
    return out


def test_a_made_checkpoints_tokenizer_carries_a_schema_and_a_regex(tmp_path: Any) -> None:
    # pd-bench make-model's tokenizer.json (the GPU check's model): llguidance could not
    # read its word-level one (no decoder it knows, no encoding of the text a grammar
    # forces), so no structured request ran on a made checkpoint.
    from engine.bench.models import write_tokenizer
    from engine.tokenizer import load_tokenizer

    write_tokenizer(str(tmp_path), TINY_VOCAB, 2048)
    tok = load_tokenizer(str(tmp_path))
    assert tok.decode(tok.encode("the city river", add_special_tokens=False)) == "the city river"
    assert len(tok.encode("the city river", add_special_tokens=False)) == 3  # a word a token
    compiler = GrammarCompiler(lambda: tok, TINY_VOCAB)
    limit = json.dumps({**SCHEMA, "properties": {**SCHEMA["properties"], "n": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": [*SCHEMA["required"], "n"]})  # fmt: skip
    for seed in range(5):
        schema = _walk(
            GrammarState(compiler.new_matcher(StructuredOutput.json_schema(limit))),
            TINY_VOCAB,
            seed,
        )
        value = json.loads(tok.decode(schema))
        assert 0 <= value.pop("n") <= 999
        _check_schema(json.dumps(value))
        regex = _walk(
            GrammarState(compiler.new_matcher(StructuredOutput.regex(REGEX))), TINY_VOCAB, seed
        )
        assert re.fullmatch(REGEX, tok.decode(regex)), tok.decode(regex)


def test_an_llguidance_taking_one_eos_id_is_given_the_first(
    monkeypatch: Any, tmp_path: Any
) -> None:
    # llguidance before 1.7 (1.6.1 is the newest wheel for glibc 2.28) takes one EOS id:
    # a list was a TypeError, so no checkpoint's tokenizer could be built there.
    import llguidance

    from engine.bench.models import write_tokenizer
    from engine.structured.compiler import ll_tokenizer
    from engine.tokenizer import load_tokenizer

    real, given = llguidance.LLTokenizer, []

    def one_eos(*args: Any, eos_token: Any = None, **kw: Any) -> Any:
        if isinstance(eos_token, list):
            raise TypeError(
                "argument 'eos_token': 'list' object cannot be interpreted as an integer"
            )
        given.append(eos_token)
        return real(*args, eos_token=eos_token, **kw)

    monkeypatch.setattr(llguidance, "LLTokenizer", one_eos)
    write_tokenizer(str(tmp_path), TINY_VOCAB, 2048)
    tok = load_tokenizer(str(tmp_path))
    monkeypatch.setattr(type(tok), "eos_token_ids", property(lambda self: [2, 5]))
    assert ll_tokenizer(tok, TINY_VOCAB) is not None and given == [2]


def test_a_refused_token_is_told_apart_from_one_the_mask_allowed() -> None:
    """What the scheduler reads when the matcher refuses a token: whether the last mask
    allowed it (``masked_out``: the grammar's own limits stopped it, a 400, or a token
    sampled outside the mask, a bug), whether a mask allows anything besides the bad
    words' ban (``allows_any_but``), and the matcher's reason on one line."""
    from engine.structured.matcher import allowed_ids_array, allows_any_but

    compiler = _compiler()
    fresh = GrammarState(compiler.new_matcher(StructuredOutput.regex("a{1000000}")))
    assert not fresh.masked_out(ord("x"))  # no mask made yet (a prefill node's token)
    buf = fill_bitmask([(0, fresh)], TINY_VOCAB)
    assert fresh.masked_out(ord("x")) and not fresh.masked_out(ord("a"))
    assert not fresh.accept(ord("a"))  # allowed, and past llguidance's limits
    assert "too many" in fresh.error and "\n" not in fresh.error
    words = (TINY_VOCAB + 31) // 32
    state = GrammarState(compiler.new_matcher(StructuredOutput.choice(["ab", "cd"])))
    buf = fill_bitmask([(0, state)], TINY_VOCAB)
    mask = buf[:words]
    assert allows_any_but(mask, [ord("a")], None)
    assert not allows_any_but(mask, [ord("a"), ord("c")], None)
    assert not allows_any_but(mask, [ord("c")], allowed_ids_array([ord("c"), 5], TINY_VOCAB))
    assert allows_any_but(mask, [ord("c"), 10**6], allowed_ids_array([97], TINY_VOCAB))
    assert list(buf[:words]) == list(mask)  # the step's mask itself is left as it was


def test_the_sampler_applies_the_mask_first_and_min_tokens_yields_to_it() -> None:
    torch = pytest.importorskip("torch")
    from engine.sampling_params import SamplingParams
    from engine.worker.sampler import Sampler

    compiler = _compiler()
    state = GrammarState(compiler.new_matcher(StructuredOutput.choice(["ab"])))
    logits = torch.randn(3, TINY_VOCAB)
    logits[:, 7] = 50.0  # what every row would pick unconstrained
    greedy = [SamplingParams(temperature=0.0)] * 3
    buf = fill_bitmask([(1, state)], TINY_VOCAB)
    out = Sampler().sample(logits, greedy, [0, 0, 0], grammar=buf)
    assert out == [7, ord("a"), 7]  # only row 1 is constrained
    seeded = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    assert Sampler().sample(logits, seeded, [5, 5, 5], grammar=buf)[1] == ord("a")
    # The grammar done: only EOS is allowed; min_tokens' ban of EOS is lifted for the row.
    for t in b"ab":
        assert state.accept(t)
    buf = fill_bitmask([(0, state)], TINY_VOCAB)
    eos = ByteTokenizer.EOS
    out = Sampler().sample(logits[:1], greedy[:1], [0], banned=[(eos,)], grammar=buf)
    assert out == [eos]


# -- the engine (offline LLM, tiny model, worker processes) ------------------------------------

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def llm() -> Any:
    from engine.config import CacheConfig, EngineConfig
    from engine.llm import LLM

    with LLM(EngineConfig(cache=CacheConfig(num_blocks=256))) as engine:
        yield engine


def _gen(llm: Any, prompts: list[str], so: StructuredOutput | None, **kw: Any) -> list[str]:
    from engine.sampling_params import SamplingParams

    tok = ByteTokenizer()
    params = [
        SamplingParams(
            **{"max_tokens": 64, **kw, "seed": kw.get("seed", 0) + i}, structured_output=so
        )
        for i in range(len(prompts))
    ]
    return [
        tok.decode(ids) for ids in llm.generate_token_ids([tok.encode(p) for p in prompts], params)
    ]


@pytest.mark.slow
def test_engine_output_follows_a_regex_a_choice_and_a_schema(llm: Any) -> None:
    prompts = ["hello there", "x", "a longer prompt for the tiny model"]
    for text in _gen(llm, prompts, StructuredOutput.regex(REGEX), temperature=1.0):
        assert re.fullmatch(REGEX, text), text
    for text in _gen(
        llm, prompts * 2, StructuredOutput.choice(["red", "green", "blue"]), temperature=1.0
    ):
        assert text in ("red", "green", "blue"), text
    for text in _gen(llm, prompts, StructuredOutput.json_schema(SCHEMA), max_tokens=200, **GREEDY):
        _check_schema(text)
    for text in _gen(llm, prompts, StructuredOutput.json_object(), max_tokens=300, temperature=1.0):
        assert text.startswith("{")  # may be cut by max_tokens: then not valid JSON
    # max_tokens still bounds it: the output is the grammar's prefix.
    (cut,) = _gen(llm, ["x"], StructuredOutput.regex(REGEX), max_tokens=2, **GREEDY)
    assert len(cut) == 2 and cut.isdigit()


def _one(llm: Any, so: StructuredOutput | None, **kw: Any) -> Any:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(
        **{"max_tokens": 16, "temperature": 0.0, "logprobs": 0, **kw}, structured_output=so
    )
    return llm.generate({"prompt_token_ids": list(b"hi")}, params)[0].outputs[0]


@pytest.mark.slow
def test_a_grammar_ended_answer_ends_with_eos_as_an_eos_ended_one(llm: Any) -> None:
    """vLLM's convention: a complete grammar allows only EOS, which is sampled and ends
    the answer as any EOS does -- in ``token_ids`` (and the usage), with its log
    probability, its text left out (``skip_special_tokens`` false would show it),
    ``stop_reason`` null. The reference is an answer EOS ended where the grammar could
    still go on (a regex ``a+``; a logit bias picks EOS once it is allowed)."""
    eos = ByteTokenizer.EOS
    plain = {"skip_special_tokens": False}
    free = _one(llm, StructuredOutput.regex("a+"), logit_bias={eos: 100.0}, **plain)
    assert free.token_ids == [ord("a"), eos] and free.text == "a"
    for kw in ({}, plain, {"min_tokens": 8, **plain}):  # min_tokens yields to the grammar
        out = _one(llm, StructuredOutput.choice(["ab"]), **kw)
        assert out.token_ids == [*b"ab", eos], kw
        assert (out.text, out.finish_reason, out.stop_reason) == (
            "ab", free.finish_reason, free.stop_reason
        ), kw  # fmt: skip
        assert len(out.logprobs) == len(out.token_ids), kw
        assert list(out.logprobs[-1]) == [eos], kw
    # No room left for EOS: the answer is cut, "length" (vLLM's too).
    cut = _one(llm, StructuredOutput.choice(["ab"]), max_tokens=2)
    assert (cut.token_ids, cut.finish_reason) == (list(b"ab"), "length")


@pytest.mark.slow
def test_a_grammar_ended_answer_whose_allowed_token_ids_have_no_eos(llm: Any) -> None:
    """``allowed_token_ids`` without EOS: the complete grammar ends the answer itself,
    at its last token (it cannot take EOS; not a stuck request)."""
    out = _one(llm, StructuredOutput.choice(["ab"]), allowed_token_ids=list(b"abc"))
    assert (out.token_ids, out.text, out.finish_reason) == (list(b"ab"), "ab", "stop")
    assert out.stop_reason is None


@pytest.mark.slow
def test_a_grammar_that_allows_the_unconstrained_output_changes_nothing(llm: Any) -> None:
    """Masking ids the model would not pick anyway leaves the output as it was, greedy and
    seeded (the exponential race's winner among the allowed ids is the overall winner when
    it is allowed). The random tiny model mostly picks ids past the byte vocabulary, which
    no grammar allows: ``allowed_token_ids`` keeps it to lowercase letters first, and the
    grammar allows every letter (and more)."""
    letters = list(range(ord("a"), ord("z") + 1))
    so = StructuredOutput.regex("[a-z0-9 ]{1,16}")
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}):
        free = _gen(llm, ["hello there", "x"], None, max_tokens=16, allowed_token_ids=letters, **kw)
        assert all(len(t) == 16 and t.isalpha() for t in free), free
        got = _gen(llm, ["hello there", "x"], so, max_tokens=16, allowed_token_ids=letters, **kw)
        assert got == free


@pytest.mark.slow
def test_a_grammar_that_allows_no_next_token_ends_the_request_with_its_reason(llm: Any) -> None:
    """No token may follow -- none of ``allowed_token_ids`` is one the grammar allows (at
    the start, or later), or the matcher is in its error state (a schema whose reference
    loops) -- so the request ends with an error that says why, found when its mask is
    made. (The row was all -inf: token 0 was sampled and refused, "internal error: output
    token 0 does not follow the structured output".)"""
    letters = list(range(ord("a"), ord("z") + 1))
    loop = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"],
            "$defs": {"A": {"$ref": "#/$defs/A"}}}  # fmt: skip
    for so, kw, why in [
        (StructuredOutput.regex("[0-9]+"), {"allowed_token_ids": letters}, "allowed_token_ids"),
        (StructuredOutput.regex("a[0-9]+"), {"allowed_token_ids": letters}, "allowed_token_ids"),
        (StructuredOutput.json_schema(loop), {}, "structured output"),
    ]:
        for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 1}):
            with pytest.raises(RuntimeError) as e:
                _gen(llm, ["hi"], so, max_tokens=16, **kw, **sampling)
            assert why in str(e.value) and "internal error" not in str(e.value), e.value


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_its_bad_words_or_its_own_limits_stop_ends_with_its_reason(
    async_scheduling: bool,
) -> None:
    """A grammar whose every next token ``bad_words`` bans (at the start, or after a token:
    a two-token word, whose ban under async scheduling is made with the deferred masks),
    or whose matcher passes llguidance's limits when it takes a token the mask allowed
    (``a{1000000}``: "too many expressions constructed"; a grammar that never ends: "Too
    many items"), ends the request with its reason, as a stuck grammar does -- the node's
    400 ``structured_output_stuck``. Found by a hostile-input round: the row of -inf drew
    token 0, or the matcher refused the token it had allowed, and the answer was a 500
    "internal error: output token N does not follow the structured output" (through the
    proxy both nodes were then taken out of rotation: 503 for everyone)."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    tok = ByteTokenizer()
    cases = [  # (structured output, bad words, what the error names)
        (StructuredOutput.regex("a+"), ((97,),), "bad_words"),
        (StructuredOutput.choice(["ab", "cd"]), ((97,), (99,)), "bad_words"),
        (StructuredOutput.regex("ab"), ((97, 98),), "bad_words"),  # 'a', then 'b' banned
        (StructuredOutput.regex("a{1000000}"), (), "too many expressions"),
        (StructuredOutput.grammar('start: a\na: "x" a'), (), "Too many items"),
    ]
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(async_scheduling=async_scheduling),
    )
    free = SamplingParams(max_tokens=12, temperature=0.0)
    with LLM(cfg) as llm:
        want = llm.generate_token_ids([tok.encode("other")], free)
        for so, bad, why in cases:
            for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 1}):
                params = SamplingParams(
                    max_tokens=16, structured_output=so, bad_words_token_ids=bad, **sampling
                )
                with pytest.raises(RuntimeError) as e:
                    llm.generate_token_ids([tok.encode("hi")], params)
                assert why in str(e.value) and "internal error" not in str(e.value), e.value
                assert "\n" not in str(e.value)  # llguidance's reason on one line (logs)
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert llm.generate_token_ids([tok.encode("other")], free) == want


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_fails_leaves_the_offline_engine_ready_for_the_next_call(
    async_scheduling: bool,
) -> None:
    """``LLM.generate`` raises when one of its requests ends with an error (here its grammar
    gets stuck after a token: under async scheduling that is found when the masks of the
    step in flight are made, ``deferred_sampling``). The call's other requests are aborted
    and the step in flight is updated before it raises: every block is free, and the next
    call answers as a fresh engine does. (They were left running, with the step in flight:
    the next call met their outputs, a KeyError, and its blocks stayed taken.)"""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    tok = ByteTokenizer()
    letters = list(range(ord("a"), ord("z") + 1))
    stuck = SamplingParams(  # 'a' is a letter; then only digits: none of them allowed
        max_tokens=16, temperature=0.0, allowed_token_ids=letters,
        structured_output=StructuredOutput.regex("a[0-9]+"),
    )  # fmt: skip
    free = SamplingParams(max_tokens=30, temperature=0.0)
    prompts = [tok.encode("hi"), tok.encode("other")]
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(async_scheduling=async_scheduling),
    )
    with LLM(cfg) as llm:
        want = llm.generate_token_ids(prompts[1:], free)
        with pytest.raises(RuntimeError, match="allowed_token_ids"):
            llm.generate_token_ids(prompts, [stuck, free])
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert llm.generate_token_ids(prompts[1:], free) == want


def test_allowed_token_ids_that_cannot_start_the_structured_output_are_a_400() -> None:
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from engine.server.app import build_app

    engine = SimpleNamespace(model_name="m", max_model_len=4096, vocab_size=TINY_VOCAB,
                             tokenizer=ByteTokenizer(), dead_reason=None, healthy=True,
                             grammars=_compiler(), stats=lambda: {}, kv_info=lambda: {})  # fmt: skip
    client = TestClient(build_app(engine))  # type: ignore[arg-type]
    letters = list(range(ord("a"), ord("z") + 1))
    for path, body in [
        ("/v1/completions", {"prompt": "x", "guided_regex": "[0-9]+"}),
        ("/v1/chat/completions", {"messages": _MSG, "response_format": {"type": "json_object"}}),
    ]:
        resp = client.post(path, json={**body, "allowed_token_ids": letters})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "allowed_token_ids" and "structured output" in err["message"]
    # Found later (the engine ended the request): a 400 too, not a 500.
    from engine.server.jobs import engine_error

    e = engine_error(engine, "none of 'allowed_token_ids' ...", "structured_output_stuck")  # type: ignore[arg-type]
    assert e.status_code == 400


@pytest.mark.slow
def test_preempted_structured_requests_resume_with_their_grammar_state() -> None:
    """Few blocks and a small token budget: requests are preempted and recomputed; their
    greedy outputs are what a roomy engine answers, and still match the schema."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm import LLM

    prompts = ["p" * n for n in (5, 40, 70, 90, 20, 60)]
    so = StructuredOutput.json_schema(SCHEMA)
    with LLM(EngineConfig(cache=CacheConfig(num_blocks=256))) as roomy:
        want = _gen(roomy, prompts, so, max_tokens=120, **GREEDY)
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=20),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
    )
    with LLM(cfg) as tight:
        got = _gen(tight, prompts, so, max_tokens=120, **GREEDY)
        stats = tight.stats()
    assert stats["num_preemptions_total"] > 0, "the test should exercise preemption"
    assert got == want
    for text in got:
        _check_schema(text)


@pytest.mark.slow
def test_async_scheduling_gives_the_same_structured_outputs() -> None:
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm import LLM

    prompts = ["one", "two two", "three three three"]
    so = StructuredOutput.json_schema(SCHEMA)
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=256), scheduler=SchedulerConfig(async_scheduling=False)
    )
    with LLM(cfg) as sync:
        want = _gen(sync, prompts, so, max_tokens=120, temperature=1.0)
    acfg = EngineConfig(
        cache=CacheConfig(num_blocks=256), scheduler=SchedulerConfig(async_scheduling=True)
    )
    with LLM(acfg) as asyn:
        assert _gen(asyn, prompts, so, max_tokens=120, temperature=1.0) == want
    for text in want:
        _check_schema(text)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "defer", "tp"),
    [("uni", "0", 1), ("mp", "0", 1), ("uni", "1", 1), ("mp", "1", 1), ("mp", "1", 2)],
)
def test_async_scheduling_steps_a_constrained_request_every_step(
    backend: str, defer: str, tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under async scheduling a constrained request is scheduled ahead of its token in
    flight (its mask is made after that token's update, while the step's forward runs):
    each of its steps goes to the workers while the one before is still in flight, as an
    unconstrained request's do -- and it samples what sync scheduling samples. One grammar
    ends (after 5 tokens and its EOS) while a step that samples for it is in flight."""
    from engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.worker.model_runner import DEFER_READBACK_ENV

    # "1": the sampled ids read back after the next launch (CUDA's way): the worker sends
    # the step before's output, which the mask needs, before it waits for the mask.
    monkeypatch.setenv(DEFER_READBACK_ENV, defer)
    tok = ByteTokenizer()
    prompts = [tok.encode(p) for p in ["steps", "free", "digits"]]
    params = [
        SamplingParams(
            max_tokens=40,
            temperature=1.0,
            seed=i,
            structured_output=so and StructuredOutput.regex(so),
        )
        for i, so in enumerate(["[a-z]{40}", None, "[0-9]{5}"])
    ]
    sync = SchedulerConfig(async_scheduling=False)
    with LLM(EngineConfig(cache=CacheConfig(num_blocks=64), scheduler=sync)) as sync_llm:
        want = sync_llm.generate_token_ids(prompts, params)
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(async_scheduling=True),
        parallel=ParallelConfig(tp=tp, distributed_executor_backend=backend),  # type: ignore[arg-type]
    )
    with LLM(cfg) as asyn:
        core, overlapped = asyn.core, []
        execute = core.executor.execute_model

        def counting(sched: Any, non_block: bool = False) -> Any:
            # Steps sent and not updated yet, this one included: 2 while one is in flight.
            overlapped.append(len(core.scheduler.in_flight.scheduled) == 2)
            return execute(sched, non_block)

        core.executor.execute_model = counting  # type: ignore[method-assign]
        got = asyn.generate_token_ids(prompts, params)
    assert got == want
    assert [len(ids) for ids in got] == [40, 40, 6] and got[2][-1] == tok.EOS
    assert tok.decode(got[2]).isdigit()
    # The prompts' step goes alone; every decode step behind the step before it (without
    # the overlap, every other schedule found nothing to send and the steps went one by one).
    assert len(overlapped) == 40 and sum(overlapped) == 39, overlapped


# -- live: a node, and P/D through the proxy ---------------------------------------------------


@pytest.fixture(scope="module")
def live_nodes(module_procs: Procs) -> dict[str, PD]:
    """Both modes' nodes, started at once (their start-ups overlap; idle, a node costs
    next to nothing): each a P/D pair and a colocated node; with ``async``, every node
    runs ``--async-scheduling`` (the default), with ``sync`` ``--no-async-scheduling``."""
    modes = (("sync", ("--no-async-scheduling",)), ("async", ("--async-scheduling",)))
    pairs = {
        mode: module_procs.pd(1, 1, "--num-blocks", "256", *extra, colocated=True, wait=False)
        for mode, extra in modes
    }
    wait_healthy(*(node for pair in pairs.values() for node in pair.all))
    return pairs


@pytest.fixture(scope="module", params=["sync", "async"])
def pd(
    module_procs: Procs, live_nodes: dict[str, PD], request: pytest.FixtureRequest
) -> Iterator[tuple[PD, Proc]]:
    """A P/D pair behind a proxy, and a colocated node; with ``async``, every node runs
    ``--async-scheduling`` (D's constrained decodes get their masks after the token in
    flight, P's first token included)."""
    pair = live_nodes[request.param]
    proxy = module_procs.proxy([pair.p.url], [pair.d.url])
    yield pair, proxy
    stop(proxy, *pair.all)  # this mode's tests are done


def _post(url: str, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    resp = httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)
    assert resp.status_code == status, resp.text
    return resp.json()


def _stream_text(url: str, path: str, body: dict[str, Any]) -> tuple[str, list[int], Any]:
    body = {"model": MODEL, **body, "stream": True}
    with httpx.stream("POST", url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        events = sse_events(resp)
    text, ids, reason = "", [], None
    for e in events:
        if not isinstance(e, dict) or not e["choices"]:
            continue
        c = e["choices"][0]
        text += c["delta"].get("content") or "" if "delta" in c else c["text"]
        ids += c.get("token_ids") or []
        reason = c["finish_reason"] or reason
    return text, ids, reason


JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
}


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_answers_follow_the_grammar_and_p_d_equals_colocated(
    pd: tuple[PD, Proc], through: str
) -> None:
    pair, proxy = pd
    assert pair.colocated is not None
    ref, url = pair.colocated.url, pair.colocated.url if through == "node" else proxy.url
    for body, path in [
        ({"messages": _MSG, "max_tokens": 200, "temperature": 0.0,
          "response_format": JSON_SCHEMA_FORMAT}, "/v1/chat/completions"),
        ({"prompt": "hello", "max_tokens": 200, "temperature": 1.0, "seed": 11,
          "structured_outputs": {"json": SCHEMA}}, "/v1/completions"),
        ({"prompt": "hello", "max_tokens": 200, "temperature": 1.0,
          "guided_json": SCHEMA}, "/v1/completions"),  # unseeded: P and D agree anyway
    ]:  # fmt: skip
        chat = path.endswith("chat/completions")
        got = _post(url, path, body)["choices"][0]
        text = got["message"]["content"] if chat else got["text"]
        _check_schema(text)
        assert got["finish_reason"] == "stop"
        if "seed" in body or body["temperature"] == 0.0:
            want = _post(ref, path, body)["choices"][0]
            assert got["token_ids"] == want["token_ids"]
        streamed, ids, reason = _stream_text(url, path, body)
        _check_schema(streamed)
        assert reason == "stop"
        if "seed" in body or body["temperature"] == 0.0:
            assert streamed == text
    # A regex and a choice, a stream of each, several choices (each its own matcher).
    body = {"prompt": "x", "max_tokens": 20, "temperature": 1.0, "seed": 5, "n": 3,
            "guided_regex": REGEX}  # fmt: skip
    answers = _post(url, "/v1/completions", body)["choices"]
    assert len(answers) == 3 and all(re.fullmatch(REGEX, a["text"]) for a in answers)
    assert answers == _post(ref, "/v1/completions", body)["choices"]
    body = {"prompt": "x", "max_tokens": 20, "temperature": 1.0, "seed": 1,
            "structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}  # fmt: skip
    text, _, reason = _stream_text(url, "/v1/completions", body)
    assert text in ("alpha", "beta", "gamma") and reason == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_bad_grammars_are_400s(pd: tuple[PD, Proc], through: str) -> None:
    pair, proxy = pd
    assert pair.colocated is not None
    url = pair.colocated.url if through == "node" else proxy.url
    for body, param in [
        ({"prompt": "x", "guided_regex": "[0-9"}, "guided_regex"),
        ({"prompt": "x", "guided_json": {"type": "strin"}}, "guided_json"),
        ({"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ]:
        err = _post(url, "/v1/completions", body, status=400)["error"]
        assert err["param"] == param, err


SQL_TEXT = r"SELECT [a-zA-Z_]\w*(,[a-zA-Z_]\w*)* FROM [a-zA-Z_]\w*"


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_a_standard_lark_grammar_is_answered_in_its_language(
    pd: tuple[PD, Proc], through: str
) -> None:
    pair, proxy = pd
    assert pair.colocated is not None
    url = pair.colocated.url if through == "node" else proxy.url
    from test_structured_lark import SQL  # vLLM's docs' Lark grammar, '?' prefixes and all

    # A few letters and EOS: a random model reaches " FROM " and the end soon.
    allowed = [*sorted(set(b"SELECT FROM,ab")), ByteTokenizer.EOS]
    body = {"prompt": "SQL:", "max_tokens": 200, "temperature": 1.0, "seed": 1,
            "allowed_token_ids": allowed, "guided_grammar": SQL}  # fmt: skip
    got = _post(url, "/v1/completions", body)["choices"][0]
    assert re.fullmatch(SQL_TEXT, got["text"], re.ASCII), got
    assert got["finish_reason"] == "stop", got


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_a_grammar_its_bad_words_or_limits_stop_is_a_400_and_harms_no_one(
    pd: tuple[PD, Proc], through: str
) -> None:
    """A grammar that ``bad_words`` leave no token, or that passes llguidance's limits on a
    token its mask allowed, is the client's 400 ``structured_output_stuck`` (body and
    stream); through the proxy no node is counted failed, and the next request is served.
    (Each was a node's 500 "internal error"; the proxy took P and D out of rotation for
    it, and the requests after it got 503 "no healthy prefill/decode pair".)"""
    pair, proxy = pd
    assert pair.colocated is not None
    url = pair.colocated.url if through == "node" else proxy.url
    ok = {"prompt": "hello", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    want = _post(pair.colocated.url, "/v1/completions", ok)["choices"][0]["token_ids"]
    failures = metric(proxy.url, "pdproxy_node_failures_total")
    for extra in [
        {"guided_regex": "a+", "bad_words": ["a"]},
        {"guided_choice": ["ab", "cd"], "bad_words": ["a", "c"], "temperature": 1.0},
        {"guided_regex": "a{1000000}"},
        {"guided_grammar": 'start: a\na: "x" a'},
    ]:
        for stream in (False, True):
            body = {"model": MODEL, "prompt": "x", "max_tokens": 8, **extra, "stream": stream}
            resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert resp.status_code == 400, (extra, resp.text)
            err = resp.json()["error"]
            assert err["code"] == "structured_output_stuck", resp.text
            # The field whose grammar could not go on (was null).
            assert err["param"] == next(k for k in extra if k.startswith("guided_")), err
            got = _post(url, "/v1/completions", ok)["choices"][0]["token_ids"]
            assert got == want, extra
    assert metric(proxy.url, "pdproxy_node_failures_total") == failures


@pytest.mark.slow
@pytest.mark.parametrize("through", ["node", "proxy"])
def test_live_a_draw_at_the_largest_uniform_keeps_to_the_grammar(
    pd: tuple[PD, Proc], through: str
) -> None:
    """Seed 46881 at position 2 (the prompt "hi": P's sample too) draws id 80 ('P') with
    the sampler's largest uniform, which was exactly 1.0 in float32: the masked id's
    ``0 / -log(1)`` was NaN and argmax took it (tests/test_sampler.py). The grammar's
    answer was a 500 "output token 80 does not follow the structured output" (through the
    proxy, the prefill node then out of rotation); ``allowed_token_ids`` answered 'P'."""
    pair, proxy = pd
    assert pair.colocated is not None
    url = pair.colocated.url if through == "node" else proxy.url
    digits = list(range(ord("0"), ord("9") + 1))
    base = {"prompt": "hi", "max_tokens": 1, "temperature": 1.0, "seed": 46881}
    for extra in ({"guided_regex": "[0-9]"}, {"allowed_token_ids": digits}):
        (choice,) = _post(url, "/v1/completions", {**base, **extra})["choices"]
        assert choice["text"].isdigit() and choice["token_ids"][0] in digits, choice


@pytest.mark.slow
def test_live_a_grammar_ps_first_token_completes_ends_on_d_as_colocated(
    pd: tuple[PD, Proc],
) -> None:
    """``allowed_token_ids`` without EOS and a grammar that P's first token completes: D
    ends the answer at that token ("stop"), body and stream, as a colocated node does.
    (D had made no mask for the request yet, so it did not see the grammar could not take
    EOS: the answer was a 400 ``structured_output_stuck``.)"""
    pair, proxy = pd
    assert pair.colocated is not None
    body = {"prompt": "x", "max_tokens": 8, "temperature": 1.0, "seed": 1,
            "guided_choice": ["a"], "allowed_token_ids": list(b"abc"), "return_token_ids": True}  # fmt: skip
    want = _post(pair.colocated.url, "/v1/completions", body)["choices"][0]
    assert (want["text"], want["token_ids"], want["finish_reason"]) == ("a", list(b"a"), "stop")
    got = _post(proxy.url, "/v1/completions", body)["choices"][0]
    assert (got["text"], got["token_ids"], got["finish_reason"]) == ("a", list(b"a"), "stop"), got
    assert _stream_text(proxy.url, "/v1/completions", body) == ("a", list(b"a"), "stop")


def test_a_boolean_schema_true_is_any_compact_json_and_false_is_a_400_saying_why() -> None:
    """JSON Schema's ``true`` (any value, as ``{}``) and ``false`` (none): ``true``
    compiles, compact as any schema; ``false`` is a 400 that says no value matches."""
    compiler = _compiler()
    for fields in ({"guided_json": True}, {"structured_outputs": {"json": "true"}}):
        so = parse_completion_request({"prompt": "x", **fields}).structured_output
        assert so is not None
        check_structured(so)
        state = GrammarState(compiler.new_matcher(so))
        for t in b'[1,{"a":null}]':
            assert state.accept(t), state.error
        assert not state.allows(ord(" "))  # no free whitespace, as for {}
    so = StructuredOutput.json_schema(False)
    with pytest.raises(APIError) as e:
        check_structured(so)
    assert e.value.status_code == 400 and "unsatisfiable" in e.value.message.lower(), e.value


def test_a_cached_check_names_the_field_of_the_request_at_hand() -> None:
    """The check's cache is keyed by the spec, not the field: a request that repeats a
    refused grammar through another field gets its own field in the message (never the
    earlier request's)."""
    grammar = "%%% never a grammar (cached check)"  # llguidance cannot convert it
    first = parse_completion_request({"prompt": "x", "guided_grammar": grammar})
    second = parse_completion_request({"prompt": "x", "structured_outputs": {"grammar": grammar}})
    messages = []
    for req in (first, second, first):
        with pytest.raises(APIError) as e:
            check_structured(req.structured_output)
        messages.append(e.value.message)
    assert messages[0] == messages[2]
    assert messages[1] == messages[0].replace("'guided_grammar'", "'structured_outputs.grammar'")
    assert "guided_grammar" not in messages[1], messages[1]


def test_a_regex_llguidance_panics_on_is_a_400_saying_so() -> None:
    # llguidance 1.9.1 panics (derivre's simplify: an unwrap on None) on this regex; the
    # panic is pyo3's PanicException, a BaseException the check did not catch.
    so = StructuredOutput.regex("([éü]|([éü]|é|\\{)|([^a])*)", "guided_regex")
    with pytest.raises(APIError) as e:
        check_structured(so)
    assert e.value.param == "guided_regex" and "llguidance failed" in e.value.message
