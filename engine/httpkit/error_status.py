"""The HTTP status an OpenAI-shaped error object stands for (an error event in a stream
carries no status of its own): the proxy tells a node's refusal from its failure by it,
a Responses stream the kind of its ``response.failed``."""

from __future__ import annotations

from typing import Any

from engine.httpkit.admission import OVERLOADED_CODE

# OpenAI's string ``code`` values that name a status its ``type`` does not (a rate limit's
# type is "requests" or "tokens"); any other string code is told by the type.
STRING_CODES = {"rate_limit_exceeded": 429, "context_length_exceeded": 400}


def event_status(error: dict[str, Any]) -> int:
    """The HTTP status an error event stands for: its ``code`` when that is one (vLLM's
    and SGLang's events carry the status there, an int; a gateway may render it as a
    string of digits), else OpenAI's string codes (``STRING_CODES``), else by its
    ``type`` and ``code`` as a node answers them (``invalid_request_error`` 400,
    ``rate_limit_error`` 429, 503 ``overloaded``); anything else is the node's failure
    (500)."""
    code, kind = error.get("code"), error.get("type")
    if isinstance(code, str) and code.isascii() and code.isdigit() and len(code) == 3:
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    if isinstance(code, str) and code in STRING_CODES:
        return STRING_CODES[code]
    if kind == "invalid_request_error":
        return 400
    if kind == "rate_limit_error":
        return 429
    return 503 if code == OVERLOADED_CODE else 500
