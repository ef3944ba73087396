"""Structured outputs to ``llguidance`` grammars: checked at entry, compiled, cached.

* ``check_structured_output(so)``: whether the grammar is valid, without a tokenizer (the
  proxy's check, and the node's before it compiles); results are cached by the spec.
* ``GrammarCompiler``: a node's compiler, for its tokenizer. ``compile`` builds the
  grammar's matcher once (the lexer, the token trie walk: milliseconds, up to a second for
  a huge schema; ``llguidance`` drops the GIL meanwhile) and keeps it in a bounded LRU;
  each request gets a ``deep_copy`` of it (microseconds). The HTTP layer compiles in its
  request thread, so the engine loop's ``new_matcher`` finds it cached.

Hostile grammars are bounded by ``llguidance``'s own limits (``PARSER_LIMITS``: lexer
fuel, lexer states, grammar size): a grammar past them is an error at compile time (a
400), and a step's mask computation past its fuel puts the matcher in its error state
(the request ends with an error), never a hang.

``llguidance`` is imported only here and only on a structured request (``import_llguidance``:
a missing package is a 400 that says how to install it).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from types import ModuleType
from typing import Any

from engine.sampling_params import InvalidRequestError
from engine.structured.lark_grammar import is_gbnf, llguidance_lark
from engine.structured.matcher import is_llguidance_failure, is_rust_panic
from engine.structured.spec import StructuredOutput

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'pdserve[structured]'"
# Compiled grammars kept per node (each a few KB to a few MB for a large schema) and
# validation results kept per process.
COMPILE_CACHE_SIZE = 256
CHECK_CACHE_SIZE = 1024
# llguidance's limits, tighter than its defaults where a request could cost the node
# memory (250k lexer states are ~0.5 GB) or a step's time.
PARSER_LIMITS: dict[str, int | bool] = {
    "max_lexer_states": 50_000,
    "max_grammar_size": 100_000,
    "initial_lexer_fuel": 1_000_000,  # ~20 ms of regex analysis at compile time
    "step_lexer_fuel": 200_000,  # ~15 ms of lexer work per mask at most
    "step_max_items": 50_000,
    "verbose_errors": False,  # errors go to clients: no parser state in them
}
# JSON is generated compact (no free whitespace between tokens: a model cannot spend its
# budget on blanks); vLLM's ``disable_any_whitespace``.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


class StructuredOutputUnavailable(InvalidRequestError):
    """``llguidance`` is not installed."""


def import_llguidance(param: str) -> ModuleType:
    """The ``llguidance`` module, or a 400 naming ``param`` that says how to get it."""
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputUnavailable(
            f"'{param}' (structured output) needs the llguidance package, which this server "
            f"does not have: {INSTALL_HINT}",
            param,
        ) from None
    return llguidance


def grammar_text(so: StructuredOutput, llg: ModuleType) -> str:
    """The llguidance grammar of ``so`` (raises ``InvalidRequestError`` when it cannot be
    built, e.g. a schema that is not an object)."""
    try:
        return _build(so, llg)
    except (ValueError, RecursionError) as e:
        raise _invalid(so, str(e)) from None


def _build(so: StructuredOutput, llg: ModuleType) -> str:
    """``grammar_text`` raising llguidance's own error (no request field in it)."""
    if so.kind == "json":
        return _json_grammar(so.spec, llg)
    if so.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=JSON_OPTIONS)
    if so.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in json.loads(so.spec))
        return llg.LLMatcher.grammar_from_lark(lark)
    if is_gbnf(so.spec):
        return llg.grammar_from("grammar", so.spec)  # GBNF, converted to Lark
    return llg.LLMatcher.grammar_from_lark(llguidance_lark(so.spec))


def _json_grammar(spec: str, llg: ModuleType) -> str:
    """A JSON schema's grammar, compact. A boolean schema takes no options (llguidance
    refuses ``defaults`` on one): ``true`` is ``{}`` (any value), ``false`` goes as it is
    (no value matches: the check says so)."""
    if spec == "false":
        return llg.LLMatcher.grammar_from_json_schema(spec)
    if spec == "true":
        spec = "{}"
    return llg.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)


def _invalid(so: StructuredOutput, reason: str) -> InvalidRequestError:
    reason = " ".join(reason.split())[:500]
    return InvalidRequestError(f"'{so.param}' is not a valid {_what(so)}: {reason}", so.param)


def copy_matcher(template: Any, so: StructuredOutput) -> Any:
    """A request's own copy of a compiled matcher; an llguidance failure making it (an
    exception, or a Rust panic) is ``so``'s ``InvalidRequestError``, not the caller's
    crash (the engine thread's, offline)."""
    try:
        return template.deep_copy()
    except BaseException as e:  # noqa: BLE001 -- a Rust panic is pyo3's BaseException
        if not is_llguidance_failure(e):
            raise
        raise _invalid(so, f"llguidance failed on it ({type(e).__name__}: {e})") from None


def _what(so: StructuredOutput) -> str:
    return {
        "json": "JSON schema",
        "json_object": "JSON object constraint",
        "regex": "regular expression",
        "choice": "list of choices",
        "grammar": "grammar",
    }[so.kind]


def parser_limits(llg: ModuleType) -> Any:
    return llg.LLParserLimits(**PARSER_LIMITS)


class _LRU:
    """A bounded, thread-safe LRU map."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


# key -> "" (valid) or llguidance's reason it is not: keyed by the spec, so the reason
# names no request's field (each request's error names its own).
_checked = _LRU(CHECK_CACHE_SIZE)


def check_structured_output(so: StructuredOutput) -> None:
    """Raise ``InvalidRequestError`` naming ``so.param`` unless its grammar is valid
    (no tokenizer needed: the proxy checks with it; a node compiles too). Cached."""
    llg = import_llguidance(so.param)
    reason = _checked.get(so.key)
    if reason is None:
        try:
            reason = llg.LLMatcher.validate_grammar(_build(so, llg), limits=parser_limits(llg))
        except (ValueError, RecursionError) as e:
            reason = str(e) or type(e).__name__
        except BaseException as e:  # noqa: BLE001 -- a Rust panic is pyo3's BaseException
            if not is_rust_panic(e):
                raise
            reason = f"llguidance failed on it ({str(e).strip()[:200]})"
        _checked.put(so.key, reason)
    if reason:
        raise _invalid(so, reason)


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """An ``llguidance.LLTokenizer`` over the model's ``vocab_size`` ids (the logits'
    width; ids past the tokenizer's vocabulary are never allowed). A ``tokenizers``
    checkpoint is handed over as its JSON; any other tokenizer (the byte tokenizer of
    ``tiny``) as its tokens' bytes."""
    llg = import_llguidance("structured_outputs")
    as_json = getattr(tokenizer, "to_json", None)
    eos = list(tokenizer.eos_token_ids) or [0]
    if as_json is not None:
        try:
            return llg.LLTokenizer(as_json(), n_vocab=vocab_size, eos_token=eos)
        except TypeError:  # llguidance < 1.7 takes one EOS id (1.6.1: glibc 2.28 wheels)
            if len(eos) > 1:
                logger.warning(
                    "structured outputs: this llguidance takes one EOS id; a grammar's end "
                    "allows %d, not the others of %s",
                    eos[0], eos,
                )  # fmt: skip
            return llg.LLTokenizer(as_json(), n_vocab=vocab_size, eos_token=eos[0])
    return llg.LLTokenizer(llg.TokenizerWrapper(_BytesVocab(tokenizer, vocab_size)))


class _BytesVocab:
    """What ``llguidance.TokenizerWrapper`` reads: each id's bytes (``b""`` past the
    tokenizer's vocabulary), the special ids, and encoding."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        n = min(tokenizer.vocab_size, vocab_size)
        special = {tokenizer.bos_token_id, *tokenizer.eos_token_ids} - {None}
        self.eos_token_id = (list(tokenizer.eos_token_ids) or [0])[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(special)
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)] + [b""] * (vocab_size - n)
        self._tok = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tok.encode(text, add_special_tokens=False))


class GrammarCompiler:
    """A node's compiled grammars for its tokenizer (``tokenizer_source`` is called once,
    on the first structured request: a node that never gets one never builds the
    ``LLTokenizer``, ~1 s for a 150k vocabulary)."""

    def __init__(
        self,
        tokenizer_source: Callable[[], Any],
        vocab_size: int,
        cache_size: int = COMPILE_CACHE_SIZE,
    ) -> None:
        self._source = tokenizer_source
        self.vocab_size = vocab_size
        self._ll: Any = None
        self._lock = threading.Lock()
        self._cache = _LRU(cache_size)

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                self._ll = ll_tokenizer(self._source(), self.vocab_size)
                logger.info(
                    "structured outputs: llguidance tokenizer built (%d ids)", self.vocab_size
                )
            return self._ll

    def compile(self, so: StructuredOutput) -> Any:
        """The grammar's matcher in its start state (shared: copy it, never advance it).
        Raises ``InvalidRequestError`` naming ``so.param`` when the grammar does not
        compile (or is past the limits)."""
        template = self._cache.get(so.key)
        if template is not None:
            return template
        llg = import_llguidance(so.param)
        check_structured_output(so)
        matcher = llg.LLMatcher(
            self._tokenizer(), grammar_text(so, llg), log_level=0, limits=parser_limits(llg)
        )
        if matcher.is_error():
            raise _invalid(so, matcher.get_error())
        self._cache.put(so.key, matcher)
        return matcher

    def new_matcher(self, so: StructuredOutput) -> Any:
        """A fresh matcher of ``so``'s grammar, for one request."""
        return copy_matcher(self.compile(so), so)

    @property
    def num_cached(self) -> int:
        return len(self._cache)
