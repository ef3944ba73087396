"""The grammars of ``pd-bench offline --structured``: one per request (``structured_specs``),
as the engine takes them (``structured_output``), and a check of an answer against one
(``structured_error``, by hand: no jsonschema dependency)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

STRUCTURED_KINDS = ("json", "regex")
# --structured's default --output-len: room for the longest object of a schema below
# (69 characters, one token each at worst, but a byte each with a byte tokenizer: 117
# bytes when its 16-character string is of 4-byte characters) or regex match (52).
STRUCTURED_OUTPUT_LEN = 128


def structured_specs(kind: str, n: int, seed: int) -> list[Any]:
    """One grammar per request (seeded), each naming three words of its own, so each
    request has its own compiled grammar. ``json``: a schema, an object of an integer in
    [0, 9999], an enum of the three words, a string of at most 16 characters and a
    boolean, all required, no other keys. ``regex``: one of the three words, ``-``, 1-4
    digits, then four words of 1-8 letters after a space each."""
    from engine.bench.words import WORDS

    rng = random.Random(seed)
    out: list[Any] = []
    for _ in range(n):
        words = rng.sample(WORDS, 3)
        if kind == "json":
            props = {
                "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                "kind": {"enum": words},
                "name": {"type": "string", "maxLength": 16},
                "ok": {"type": "boolean"},
            }
            out.append(
                {
                    "type": "object",
                    "properties": props,
                    "required": list(props),
                    "additionalProperties": False,
                }
            )
        else:
            out.append(f"({'|'.join(words)})-[0-9]{{1,4}}( [a-z]{{1,8}}){{4}}")
    return out


def structured_output(kind: str, spec: Any) -> Any:
    from engine.structured.spec import StructuredOutput

    if kind == "json":
        return StructuredOutput.json_schema(spec)
    return StructuredOutput.regex(spec)


def structured_error(kind: str, spec: Any, text: str) -> str | None:
    """Why ``text`` does not follow a spec of ``structured_specs`` (None: it does). The
    schema is checked by hand (no jsonschema dependency)."""
    if kind == "regex":
        return None if re.fullmatch(spec, text) else f"{text!r} does not match {spec}"
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON ({e}): {text!r}"
    props = spec["properties"]
    if not isinstance(value, dict) or set(value) != set(props):
        return f"not an object of the keys {sorted(props)}: {text!r}"
    n, name = value["id"], value["name"]
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 9999:
        return f"id is not an integer in [0, 9999]: {text!r}"
    if value["kind"] not in props["kind"]["enum"]:
        return f"kind is not one of {props['kind']['enum']}: {text!r}"
    if not isinstance(name, str) or len(name) > 16:
        return f"name is not a string of at most 16 characters: {text!r}"
    if not isinstance(value["ok"], bool):
        return f"ok is not a boolean: {text!r}"
    return None
