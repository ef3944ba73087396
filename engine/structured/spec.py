"""A request's structured output: every spelling of it parsed once into ``StructuredOutput``.

The spellings (OpenAI's and vLLM's, completions and chat alike):

* ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (``{"type": "text"}``:
  none);
* ``structured_outputs``: exactly one of ``json`` (a schema, or its text), ``regex``,
  ``choice`` (strings), ``grammar`` (Lark or GBNF), ``json_object: true``;
* the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

A request may use one of them (two at once is an error naming the second). Pure: no
``llguidance`` here (``compiler.py`` checks that the grammar compiles).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import InvalidRequestError

# Bounds on what a request may ask (a grammar is compiled, and checked every step):
# the spec's text (a schema's JSON, a regex, a grammar, the choices' JSON) and the
# number of choices.
MAX_SPEC_BYTES = 64 * 1024
# A schema pdserve builds from a request's tools (at most 64 KiB of them: each wrapped in
# {"name", "parameters"}, its $refs re-pointed) may be larger than a client's own.
MAX_DERIVED_SPEC_BYTES = 4 * MAX_SPEC_BYTES
MAX_GUIDED_CHOICES = 1024
KINDS = ("json", "regex", "choice", "grammar", "json_object")
_LEGACY = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# The request fields that carry a structured output (for the protocol's field lists).
FIELDS = ("response_format", "structured_outputs", *_LEGACY)


class UnsupportedStructuredKey(InvalidRequestError):
    """A ``structured_outputs`` key vLLM knows that pdserve does not implement (``backend``,
    ``disable_any_whitespace``, ...): an ``unsupported_parameter``, as such fields are."""


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output. ``spec`` is text: a JSON schema's JSON, a
    regex, the choices as a JSON array, a grammar; ``""`` for ``json_object`` (any JSON
    object). ``param`` is the request field it came from (named by errors); two requests
    with the same ``(kind, spec)`` share a compiled grammar."""

    kind: str
    spec: str
    param: str = field(default="structured_outputs", compare=False)
    # Built by pdserve from a request's tools (bounded by them): MAX_DERIVED_SPEC_BYTES.
    derived: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"unknown structured output kind {self.kind!r}", self.param)
        limit = MAX_DERIVED_SPEC_BYTES if self.derived else MAX_SPEC_BYTES
        try:
            size = len(self.spec.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate (the offline API; HTTP refuses it)
            raise InvalidRequestError(
                f"'{self.param}' is not valid text: it holds a lone surrogate", self.param
            ) from None
        if size > limit:
            raise InvalidRequestError(
                f"'{self.param}' is {size} bytes; a structured "
                f"output's {self.kind} may be at most {limit} bytes",
                self.param,
            )

    @functools.cached_property
    def key(self) -> bytes:
        """What the compile caches key on: a digest (an entry costs 16 bytes, not the
        spec's length)."""
        text = f"{self.kind}\0{self.spec}".encode("utf-8", "surrogatepass")
        return hashlib.blake2b(text, digest_size=16).digest()

    @classmethod
    def json_schema(
        cls, schema: Any, param: str = "structured_outputs", derived: bool = False
    ) -> StructuredOutput:
        return cls("json", _schema_text(schema, param, derived), param, derived)

    @classmethod
    def regex(cls, pattern: str, param: str = "structured_outputs") -> StructuredOutput:
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: list[str], param: str = "structured_outputs") -> StructuredOutput:
        return cls("choice", _choices_text(choices, param), param)

    @classmethod
    def grammar(cls, text: str, param: str = "structured_outputs") -> StructuredOutput:
        return cls("grammar", text, param)

    @classmethod
    def json_object(cls, param: str = "structured_outputs") -> StructuredOutput:
        return cls("json_object", "", param)


def parse_structured_output(body: dict[str, Any]) -> StructuredOutput | None:
    """The request's structured output (None: none), from whichever field carries it.
    Raises ``InvalidRequestError`` naming the field: a wrong shape, a spec too large, two
    at once."""
    found: list[StructuredOutput] = []
    for name in FIELDS:
        value = body.get(name)
        one = _parse_field(name, value)
        if one is not None:
            if found:
                raise InvalidRequestError(
                    f"'{name}' and '{found[0].param}' both ask for a structured output; a "
                    "request may use one",
                    name,
                )
            found.append(one)
    return found[0] if found else None


def _parse_field(name: str, value: Any) -> StructuredOutput | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    if value is None or value == [] or value == {}:  # the neutral values accepted before
        return None
    return _one(_LEGACY[name], value, name)


def _response_format(value: Any) -> StructuredOutput | None:
    name = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"'{name}' must be an object", name)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object(name)
    if kind == "json_schema":
        inner = value.get("json_schema")
        where = f"{name}.json_schema"
        if not isinstance(inner, dict):
            raise InvalidRequestError(f"'{where}' must be an object with a 'schema'", where)
        schema = inner.get("schema")
        if schema is None:  # vLLM's older spelling
            schema = inner.get("json_schema")
        if schema is None:
            raise InvalidRequestError(f"'{where}.schema' is required", f"{where}.schema")
        return StructuredOutput.json_schema(schema, f"{where}.schema")
    raise InvalidRequestError(
        f"'{name}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r:.40}",
        f"{name}.type",
    )


def _absent(v: Any) -> bool:
    """A ``structured_outputs`` key left out: null or false (vLLM clients send
    ``json_object: false``). By identity: ``0 in (None, False)`` is true in Python, and a
    0 is a bad value of its key, not an absent one."""
    return v is None or v is False


def _structured_outputs(value: Any) -> StructuredOutput | None:
    name = "structured_outputs"
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"'{name}' must be an object", name)
    unknown = [k for k, v in value.items() if k not in KINDS and not _absent(v)]
    if unknown:
        raise UnsupportedStructuredKey(
            f"'{name}.{unknown[0]}' is not supported (only {', '.join(KINDS)})",
            f"{name}.{unknown[0]}",
        )
    given = [k for k in KINDS if not _absent(value.get(k))]
    if len(given) != 1:
        raise InvalidRequestError(
            f"'{name}' must set exactly one of {', '.join(KINDS)}, got "
            f"{', '.join(given) or 'none'}",
            name,
        )
    kind = given[0]
    return _one(kind, value[kind], f"{name}.{kind}")


def _one(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput.json_schema(value, param)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(f"'{param}' must be true", param)
        return StructuredOutput.json_object(param)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(f"'{param}' must be an array of strings", param)
        return StructuredOutput.choice(value, param)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"'{param}' must be a non-empty string", param)
    return StructuredOutput(kind, value, param)


def _schema_text(schema: Any, param: str, derived: bool = False) -> str:
    """A JSON schema as compact JSON text (its keys in the client's order: that is the
    order properties are generated in)."""
    if isinstance(schema, str) and not derived:
        if len(schema.encode("utf-8")) > MAX_SPEC_BYTES:
            raise InvalidRequestError(
                f"'{param}' is longer than {MAX_SPEC_BYTES} bytes", param
            )  # before parsing it
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise InvalidRequestError(f"'{param}' is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(f"'{param}' must be a JSON schema (an object)", param)
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError) as e:
        raise InvalidRequestError(f"'{param}' cannot be serialised: {e}", param) from None


def _choices_text(choices: list[str], param: str) -> str:
    if not choices:
        raise InvalidRequestError(f"'{param}' must hold at least one string", param)
    if len(choices) > MAX_GUIDED_CHOICES:
        raise InvalidRequestError(
            f"'{param}' may hold at most {MAX_GUIDED_CHOICES} strings, got {len(choices)}",
            param,
        )
    if not all(choices):
        raise InvalidRequestError(f"'{param}' must not hold an empty string", param)
    return json.dumps(choices, ensure_ascii=False)
