"""Property test (hypothesis) of structured outputs at the matcher's level: a drawn
constraint (a JSON schema of the subset below, a regex, a list of choices), on the
``tiny`` model's byte tokenizer (every byte a token: multi-byte characters arrive in
partial UTF-8 pieces), walked token by token by a sampler that picks among what the mask
allows, with and without a reasoning parser's tags in front (``GrammarState``).

Asserted at every step: the mask allows some token (EOS once the grammar may end: the
matcher never dead-ends); ``allows`` agrees with the mask on drawn tokens; the state fed
token by token masks as one rebuilt from scratch on the same tokens. At the end: an
output the grammar ended (or EOS ended) is accepted by the constraint (JSON that
validates against the schema, a regex's full match, one of the choices); one cut by the
step limit is a prefix of an accepted one (choices and regexes).

At the engine's level (the ``tiny`` model, the uniprocess executor), constrained
requests -- greedy or seeded, some reasoning first (deepseek_r1 tags, steered to end
their reasoning) -- get, under async scheduling, chunked prefill, preemption and prefix
caching, what each gets alone (``test_property_engine``'s check), and an answer's content
that finished "stop" is accepted ("length": a prefix of an accepted one).

The examples are fixed (``derandomize``, no example database);
``PDSERVE_STRUCTURED_EXAMPLES=N`` multiplies their count (a local hunt).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from fakes import example_scale, fixed_examples, hunt_timeout
from hypothesis import event, given, note
from hypothesis import strategies as st

from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.structured.compiler import GrammarCompiler
from engine.structured.matcher import GrammarState, bitmask_words, fill_bitmask
from engine.structured.reasoning import Phase, ReasoningTags
from engine.structured.spec import StructuredOutput
from engine.tokenizer import ByteTokenizer

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
regex_mod = pytest.importorskip("regex")

SCALE = example_scale("PDSERVE_STRUCTURED_EXAMPLES")
VOCAB = 512  # the tiny model's logits (ids 0-255 bytes, BOS 256, EOS 257)
EOS = ByteTokenizer.EOS
MAX_STEPS = 80
START, END = "<think>", "</think>"
R1_TAGS = ReasoningTags(end=tuple(END.encode()))
Q3_TAGS = ReasoningTags(end=tuple(END.encode()), start=tuple(START.encode()))

_COMPILER = GrammarCompiler(ByteTokenizer, VOCAB)

# Characters of 1 to 4 UTF-8 bytes, quotes, escapes and the grammars' own punctuation.
CHARS = st.sampled_from(
    list("ab0Z \"\\'|/<>{}[]:,.-+*?()^$\n\t") + ["é", "€", "𝄞", "ü", "\x00", "\x7f", "\u2028", "\r"]
)
TEXT = st.text(CHARS, min_size=1, max_size=5)


# -- the constraints drawn -----------------------------------------------------------------


def schemas(depth: int = 2) -> st.SearchStrategy[dict[str, Any]]:
    leaf = st.one_of(
        st.builds(
            lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": lo + hi},
            st.integers(0, 2),
            st.integers(0, 3),
        ),
        st.builds(
            lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": lo + hi},
            st.integers(-20, 20),
            st.integers(0, 50),
        ),
        st.just({"type": "boolean"}),
        st.just(True),
        st.builds(
            lambda lo, step: {"type": "number", "exclusiveMinimum": lo, "maximum": lo + step},
            st.integers(-5, 5),
            st.sampled_from([1, 10, 2.5]),  # not 0.5: llguidance 1.9.1 then allows lo itself
        ),
        st.builds(
            lambda m: {"type": "integer", "multipleOf": m, "minimum": 0, "maximum": 30},
            st.sampled_from([2, 3, 7]),
        ),
        st.sampled_from(["^a[0-9]$", "[a-c]+", "é?x{1,2}", "^\\d{2}-\\w$"]).map(
            lambda p: {"type": "string", "pattern": p}
        ),
        st.just({"type": ["integer", "null"], "minimum": 0, "maximum": 2}),
        st.lists(
            st.one_of(st.integers(-3, 3), st.booleans(), st.none(), TEXT), min_size=1, max_size=3
        ).map(lambda e: {"enum": e}),
        st.just({"type": "null"}),
        st.lists(TEXT, min_size=1, max_size=3, unique=True).map(lambda e: {"enum": e}),
        TEXT.map(lambda c: {"const": c}),
    )
    if depth == 0:
        return leaf

    def obj(props: dict[str, Any], req: list[bool]) -> dict[str, Any]:
        names = list(props)
        return {
            "type": "object",
            "properties": props,
            "required": [n for n, r in zip(names, req, strict=False) if r],
            "additionalProperties": False,
        }

    inner = schemas(depth - 1)
    return st.one_of(
        leaf,
        st.builds(
            obj,
            st.dictionaries(TEXT, inner, min_size=1, max_size=3),
            st.lists(st.booleans(), min_size=3, max_size=3),
        ),
        st.builds(
            lambda items, lo, hi: {
                "type": "array",
                "items": items,
                "minItems": lo,
                "maxItems": lo + hi,
            },
            inner,
            st.integers(0, 1),
            st.integers(0, 2),
        ),
        st.lists(inner, min_size=2, max_size=2).map(lambda a: {"anyOf": a}),
        st.lists(inner, min_size=1, max_size=2).map(
            lambda a: {"type": "array", "prefixItems": a, "items": False}
        ),
        inner.map(lambda d: {"type": "object", "additionalProperties": d, "maxProperties": 2}),
    )


_META = ".+*?()|[]{}^$\\"


def _lit(c: str) -> str:
    return "\\" + c if c in _META else c


def regexes(depth: int = 2) -> st.SearchStrategy[str]:
    atom = st.one_of(
        CHARS.map(_lit),
        st.sampled_from(["[a-c]", "[éü]", "[0-9]", "\\d", "[^a]", "."]),
    )
    if depth == 0:
        return atom
    inner = regexes(depth - 1)
    return st.one_of(
        atom,
        st.lists(inner, min_size=1, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda a: "(" + "|".join(a) + ")"),
        st.tuples(inner, st.sampled_from(["?", "*", "+", "{1,2}", "{2}"])).map(
            lambda t: "(" + t[0] + ")" + t[1]
        ),
    )


@st.composite
def constraints(draw: st.DrawFn) -> tuple[StructuredOutput, Any]:
    kind = draw(st.sampled_from(["json", "regex", "choice"]))
    if kind == "json":
        schema = draw(schemas())
        if draw(st.booleans()):  # a reference to a definition
            schema = {"$defs": {"d": schema}, "type": "array", "items": {"$ref": "#/$defs/d"}}
        return StructuredOutput.json_schema(schema), schema
    if kind == "regex":
        pattern = draw(regexes())
        return StructuredOutput.regex(pattern), pattern
    choices = draw(st.lists(TEXT, min_size=1, max_size=4, unique=True))
    return StructuredOutput.choice(choices), choices


_JSON_STRING = regex_mod.compile(r'"(?:[^"\\]|\\.)*"')


def accepted(so: StructuredOutput, spec: Any, text: str) -> bool:
    if so.kind == "json":
        try:
            value = json.loads(text)
        except ValueError:
            return False
        # Compact: no whitespace outside strings (docs/api.md).
        compact = not any(c in " \t\n\r" for c in _JSON_STRING.sub("", text))
        return compact and jsonschema.Draft202012Validator(spec).is_valid(value)
    if so.kind == "regex":
        return regex_mod.fullmatch(spec, text) is not None
    return text in spec


def a_prefix(so: StructuredOutput, spec: Any, data: bytes) -> bool:
    """Whether ``data`` (bytes: maybe cut inside a character) may go on to be accepted
    (None: not checked here)."""
    if so.kind == "choice":
        return any(c.encode().startswith(data) for c in spec)
    if so.kind == "regex":
        text = data.decode("utf-8", errors="ignore")  # a cut character may go on
        return regex_mod.fullmatch(spec, text, partial=True) is not None
    return True


# -- the walk ------------------------------------------------------------------------------


def mask_ids(state: GrammarState) -> list[int]:
    buf = fill_bitmask([(0, state)], VOCAB)
    row = buf[: bitmask_words(VOCAB)].view(np.uint32)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB]
    return np.flatnonzero(bits).tolist()


def replay(so: StructuredOutput, tags: ReasoningTags | None, tokens: list[int]) -> GrammarState:
    state = GrammarState(_COMPILER.new_matcher(so), tags)
    for t in tokens:
        assert state.accept(t), (tokens, state.error)
    return state


def content_of(tags: ReasoningTags | None, tokens: list[int]) -> list[int] | None:
    """The tokens the grammar constrains (None: the answer still reasons)."""
    if tags is None:
        return tokens
    if tags.start and tuple(tokens[: len(tags.start)]) != tags.start:
        if tuple(tokens) == tags.start[: len(tokens)]:
            return None  # qwen3: still opening, maybe its reasoning
        return tokens  # qwen3: no reasoning opened, all content
    end = tags.end
    for i in range(len(tokens) - len(end) + 1):
        if tuple(tokens[i : i + len(end)]) == end:
            return tokens[i + len(end) :]
    return None


@hunt_timeout(SCALE)
@fixed_examples(200 * SCALE)
@given(case=constraints(), tags=st.sampled_from([None, None, R1_TAGS, Q3_TAGS]), data=st.data())
def test_a_walk_under_the_mask_ends_accepted_and_never_dead_ends(
    case: tuple[StructuredOutput, Any], tags: ReasoningTags | None, data: st.DataObject
) -> None:
    so, spec = case
    note(f"{so.kind}: {so.spec!r}; tags {tags}")
    try:
        matcher = _COMPILER.new_matcher(so)
    except InvalidRequestError as e:  # llguidance panics on a few regexes: a 400 saying so
        assert "llguidance failed" in str(e), e
        event("refused: llguidance failed on it")
        return
    state = GrammarState(matcher, tags)
    tokens: list[int] = []
    ended = False
    for _ in range(MAX_STEPS):
        allowed = mask_ids(state) if state.constrains else list(range(ByteTokenizer.EOS + 1))
        content = content_of(tags, tokens)
        if content is not None and state.constrains:
            assert a_prefix(so, spec, bytes(content)), tokens
        if state.constrains:
            assert allowed, f"a dead end after {tokens}: {state.error}"
            # Bytes, and EOS: never BOS, nor an id past the tokenizer's (logits' padding).
            assert ByteTokenizer.BOS not in allowed and allowed[-1] <= EOS, allowed
            scratch = replay(so, tags, tokens)
            assert mask_ids(scratch) == allowed, tokens
            probe = data.draw(st.integers(0, 257), label="probe")
            assert state.allows(probe) == (probe in allowed), (tokens, probe)
        # Lean towards the reasoning's tags (else a walk seldom closes them) and EOS.
        gate = state.reasoning
        hint: list[int] = []
        if gate is not None and gate.phase is Phase.OPENING:
            hint = [gate.next_start_token]
        elif gate is not None and gate.phase is Phase.REASONING:
            n = len(gate._seen)  # noqa: SLF001 -- the end tag's next token
            hint = [gate.tags.end[n] if n < len(gate.tags.end) else gate.tags.end[0]]
        if EOS in allowed:
            hint.append(EOS)
        if hint and data.draw(st.booleans(), label="hint"):
            token = data.draw(st.sampled_from(hint), label="token")
        else:
            token = data.draw(st.sampled_from(allowed), label="token")
        if not state.constrains and token == EOS:
            break  # a reasoning answer ended: nothing constrained
        tokens.append(token)
        assert state.accept(token), (tokens, state.error)
        if token == EOS:
            ended = True
            break
        if state.finished:
            ended = True
            break
    note(f"tokens {tokens}")
    out = [t for t in tokens if t != EOS]
    content = content_of(tags, out)
    event(
        f"{so.kind}: {'ended' if ended else 'cut'}, {'content' if content is not None else 'reasoning'}"
    )
    if content is None:
        return
    data_bytes = bytes(content)
    if ended:
        text = data_bytes.decode("utf-8")
        assert accepted(so, spec, text), text
    else:
        assert a_prefix(so, spec, data_bytes), data_bytes


# -- the engine: the same outputs under async scheduling, chunked prefill, preemption --------

_TAG_IDS = sorted(set((START + END).encode()))
ALPHABET = st.sampled_from([*b'ab0{}"[]:,<>/tk', EOS])
# A reasoning answer of the random model kept to the tags' characters, a "<" going on as
# "</think>" (each other tag character banned after each of its prefixes).
STEER: dict[str, Any] = {
    "logit_bias": {t: 100.0 for t in _TAG_IDS},
    "bad_words_token_ids": tuple(
        tuple(END[:k].encode()) + (c,)
        for k in range(1, len(END))
        for c in _TAG_IDS
        if c != END.encode()[k]
    ),
}


@st.composite
def engine_cases(draw: st.DrawFn) -> Any:
    from test_property_engine import Item, Setup

    setup = Setup(
        max_model_len=draw(st.sampled_from([64, 48])),
        block_size=draw(st.sampled_from([4, 16, 8])),
        extra_blocks=draw(st.sampled_from([0, 1, 64])),
        budget=draw(st.sampled_from([3, 17, 1, 2048])),
        max_num_seqs=draw(st.sampled_from([8, 3, 1])),
        async_scheduling=draw(st.booleans()),
        prefix_caching=draw(st.booleans()),
        by_priority=False,
        defer_readback=draw(st.booleans()),
    )
    items = []
    for _ in range(draw(st.integers(1, 4))):
        so, spec = draw(constraints())
        kw: dict[str, Any] = {
            "max_tokens": draw(st.sampled_from([4, 16, 30, 40])),
            "min_tokens": draw(st.sampled_from([0, 0, 3])),
            "ignore_eos": draw(st.booleans()),
            "structured_output": so,
            "logprobs": draw(st.sampled_from([None, 1])),
        }
        if draw(st.booleans()):
            kw["temperature"] = 0.0
        else:
            kw |= {
                "temperature": draw(st.sampled_from([1.0, 2.0])),
                "seed": draw(st.integers(0, 99)),
            }
            kw["top_k"] = draw(st.sampled_from([-1, 3]))
        # Constraints the grammar may leave no token under (the request then ends with
        # an error, the same one wherever it runs).
        if draw(st.integers(0, 5)) == 0:
            kw["allowed_token_ids"] = draw(st.lists(ALPHABET, min_size=1, max_size=6, unique=True))
        if draw(st.integers(0, 4)) == 0:
            words = st.lists(ALPHABET, min_size=1, max_size=2).map(tuple)
            kw["bad_words_token_ids"] = tuple(draw(st.lists(words, max_size=3)))
        if draw(st.integers(0, 4)) == 0:
            kw["logit_bias"] = draw(
                st.dictionaries(ALPHABET, st.sampled_from([-100.0, 100.0]), max_size=3)
            )
        if draw(st.integers(0, 4)) == 0:
            kw["stop_token_ids"] = draw(st.lists(ALPHABET, max_size=2))
        reasons = draw(st.sampled_from([None, None, R1_TAGS, Q3_TAGS]))
        if reasons is not None:  # it reasons first, steered to end its reasoning
            kw |= {"reasoning_tags": reasons, **STEER}
            if reasons.start:  # and to open it
                kw["logit_bias"] = {**STEER["logit_bias"], ord("<"): 100.0}
        prompt = tuple(draw(st.lists(st.integers(0, 255), min_size=1, max_size=20)))
        arrival = draw(st.sampled_from([0, 0, 2]))
        n = draw(st.sampled_from([1, 1, 2]))  # children seeded seed + j, a matcher each
        item = Item(prompt, SamplingParams(**kw), arrival=arrival, n=n)
        items.append((item, spec))
    return setup, items


@pytest.fixture(scope="module")
def reference() -> Any:
    from test_property_engine import Reference

    ref = Reference()
    try:
        yield ref
    finally:
        ref.close()


@hunt_timeout(SCALE)
@fixed_examples(20 * SCALE)
@given(case=engine_cases())
def test_constrained_requests_get_their_alone_output_under_stress(
    reference: Any, case: Any
) -> None:
    from test_property_engine import (
        assert_idle,
        blocks_needed,
        cdiv,
        engine_config,
        readback_deferred,
        run_round,
        same_logprob,
    )

    from engine.llm import LLM

    setup, pairs = case
    items = [item for item, _ in pairs]
    note(f"{setup}\n{items}")
    m, bs = setup.max_model_len, setup.block_size
    need = max(cdiv(m, bs), *(blocks_needed(item, m, bs) for item in items))
    blocks = max(2, need + setup.extra_blocks)
    cfg = engine_config(
        m,
        bs,
        blocks,
        setup.budget,
        setup.max_num_seqs,
        setup.async_scheduling,
        setup.prefix_caching,
    )
    with readback_deferred(setup.defer_readback):
        llm = LLM(cfg)
    with llm:
        got = run_round(llm, items)
        assert_idle(llm)
    for i, (item, spec) in enumerate(pairs):
        for rid, sp in item.children(i):
            want, res = reference.result(m, item, sp), got[rid]
            # The same tokens, ending and error (a stuck grammar's too) as alone.
            assert (res.tokens, res.finish_reason, res.error) == (
                want.tokens,
                want.finish_reason,
                want.error,
            ), rid
            assert all(map(same_logprob, res.logprobs, want.logprobs)), rid
            check_content(sp, spec, want, rid)


def check_content(sp: SamplingParams, spec: Any, want: Any, rid: str) -> None:
    """A request's answer (alone) is accepted by its constraint where it finished "stop"
    (not on a stop id, nor an error), else a prefix of an accepted one."""
    so = sp.structured_output
    assert so is not None
    content = content_of(sp.reasoning_tags, want.tokens)
    reasons = "reasoning, " if sp.reasoning_tags else ""
    event(f"engine {so.kind}: {reasons}{want.finish_reason}, content {content is not None}")
    if content is None or want.error is not None:
        return
    out = bytes(t for t in content if t < 256)
    if want.finish_reason == "length" or (content and content[-1] in sp.stop_token_ids):
        assert a_prefix(so, spec, out), (rid, out)
    else:
        assert accepted(so, spec, out.decode("utf-8")), (rid, out)
