"""A request body as JSON, checked before any parser sees it (``parse_json_body``):
UTF-8, nesting, integer literals past the digit limit, lone surrogates -- each a 400
``APIError``, never a 500."""

from __future__ import annotations

import json
import sys
from typing import Any

from engine.server.request_fields import APIError

MAX_JSON_DEPTH = 64


def parse_json_body(raw: bytes) -> Any:
    """A request body as JSON, or a 400 ``APIError`` that says why it is not: not JSON, not
    UTF-8, nested deeper than ``MAX_JSON_DEPTH``, or a string holding a lone surrogate
    (which no tokenizer or later UTF-8 encoding can take; ``param`` names the field)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(
            f"We could not parse the JSON body of your request: {e}", code="invalid_json"
        ) from e
    except RecursionError:  # deeper than the parser goes
        raise _too_deep() from None
    except ValueError:  # an integer literal longer than int() converts (a 500 before)
        # Parsed again, only now, marking such literals so the check names their field.
        try:
            body = json.loads(raw, parse_int=_int_or_too_long)
        except RecursionError:
            raise _too_deep() from None
    _check_json(body, None, 0)
    return body


class _TooLongInt:
    """An integer literal in a body with more digits than Python converts (4300)."""


_TOO_LONG_INT = _TooLongInt()


def _int_or_too_long(digits: str) -> int | _TooLongInt:
    try:
        return int(digits)
    except ValueError:
        return _TOO_LONG_INT


def _too_deep() -> APIError:
    return APIError(
        f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json"
    )


def _check_json(value: Any, path: str | None, depth: int) -> None:
    """``path``: where ``value`` is (``prompt[4]``, ``a.b``); None for the body itself (a
    field may be named ``""``)."""
    if depth > MAX_JSON_DEPTH:
        raise _too_deep()
    if value is _TOO_LONG_INT:
        name = "body" if path is None else path
        raise APIError(
            f"'{name}' is an integer with more than {sys.get_int_max_str_digits()} digits",
            param=path,
            code="invalid_number",
        )
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            name = "body" if path is None else path
            raise APIError(
                f"'{name}' holds an invalid Unicode character (a lone UTF-16 surrogate)",
                param=path,
                code="invalid_unicode",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_json(key, "body" if path is None else path, depth + 1)
            if item.__class__ not in _PLAIN:
                _check_json(item, str(key) if path is None else f"{path}.{key}", depth + 1)
    elif isinstance(value, list):
        if value and depth >= MAX_JSON_DEPTH:
            raise _too_deep()  # its items would be one level too deep
        if _PLAIN.issuperset(map(type, value)):  # e.g. a prompt of token ids: nothing to check
            return
        for i, item in enumerate(value):
            if item.__class__ not in _PLAIN:
                _check_json(item, f"{path or ''}[{i}]", depth + 1)


# What json.loads makes that needs no check (the too-long-int marker is its own class).
_PLAIN = frozenset({int, float, bool, type(None)})
