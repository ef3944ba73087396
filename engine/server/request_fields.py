"""What every request parser shares: ``APIError`` (an error answered as an OpenAI error
body, its ``param`` naming the offending field) and the typed field getters, each raising
one that names the field on a wrong type."""

from __future__ import annotations

import math
import sys
from typing import Any


class APIError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with ``status_code``."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status_code: int = 400,
        err_type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.err_type = err_type
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.param, self.code)


def error_body(
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------
# Typed field getters. Each raises APIError naming the field on a wrong type.
# ---------------------------------------------------------------------------------------

MISSING = object()


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def bad_type(name: str, expected: str, value: Any) -> APIError:
    return APIError(
        f"'{name}' must be {expected}, got {type_name(value)} {value!r:.60}",
        param=name,
        code="invalid_type",
    )


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, int):  # compared exactly: float() of a bigger one raises (a 500 before)
        return abs(value) <= sys.float_info.max
    return math.isfinite(value)


def get_int(body: dict[str, Any], name: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and not isinstance(value, bool):
        value = int(value)
    if not is_int(value):
        raise bad_type(name, "an integer", value)
    if not -(2**63) <= value < 2**63:  # no field means more; 4300 digits broke the messages
        raise APIError(f"'{name}' must fit in a signed 64-bit integer", param=name)
    return value


def get_float(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value):
        raise bad_type(name, "a number", value)
    return float(value)


def get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_type(name, "a boolean", value)
    return value


def get_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_type(name, "a string", value)
    return value


def unsupported(name: str, detail: str) -> APIError:
    """``'logit_bias' is not supported``; with ``detail``, ``'n' = 2 (only n = 1) is ...``."""
    what = f"'{name}' {detail}" if detail else f"'{name}'"
    return APIError(f"{what} is not supported", param=name, code="unsupported_parameter")


def text_of_parts(content: Any, where: str, kinds: dict[str, str], only: str) -> str:
    """A message's ``content`` at ``where``: a string, or an array of text parts joined by
    newlines, each ``{"type": kind, kinds[kind]: "..."}``; another part type is a 400
    saying ``only`` (which types are taken)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_type(where, "a string or an array of content parts", content)
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad_type(f"{where}[{j}]", "an object", part)
        kind = part.get("type")
        key = kinds.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise unsupported(f"{where}[{j}].type", f"= {kind!r:.40} ({only})")
        text = part.get(key)
        if not isinstance(text, str):
            raise bad_type(f"{where}[{j}].{key}", "a string", text)
        texts.append(text)
    return "\n".join(texts)


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(
            f"request body must be a JSON object, got {type_name(body)}", code="invalid_body"
        )
    return body
