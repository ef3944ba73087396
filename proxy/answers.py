"""A node's answer, checked where it enters the proxy.

The proxy trusts a node's answer no more than a client's body: a node may be a stand-in,
a different version, or broken. Everything the proxy reads of an answer (a prefill
node's JSON, a decode node's JSON or each event of its stream) passes ``check_answer``
first, so a malformed one is a ``MalformedAnswer`` -- a ``NodeProtocolError``: the node
failed, the request moves on or ends with an error event -- and never a ``TypeError``
deep in a rewrite (which cut the client's stream, or answered 500).

What is checked is what the proxy reads: the body is an object; ``choices`` a list of
objects; in a choice ``token_ids`` a list of integers, ``text`` a string, ``delta`` and
``message`` objects whose ``content`` is a string, ``finish_reason`` a string;
``kv_transfer_params`` an object whose ``first_token`` is an integer; ``usage`` an
object. Each may be absent or null, but for ``delta`` and ``message`` (absent, or an
object). ``NaN`` and ``Infinity`` are not JSON (a node's own encoder refuses them; the
proxy's would fail on them later). An error event (``{"error": ...}``) is passed on as
it is. Log probabilities are read defensively where they are used
(``engine/server/logprobs.py``).
"""

from __future__ import annotations

import json
from typing import Any

from engine.httpkit.sse_reader import refuse_constant
from proxy.node_client import NodeProtocolError


class MalformedAnswer(NodeProtocolError):
    """A node's answer (or one event of its stream) is not what a node sends."""


def parse_answer(raw: bytes | str) -> dict[str, Any]:
    """A node's JSON answer, checked (``check_answer``)."""
    try:
        obj = json.loads(raw, parse_constant=refuse_constant)
    except (ValueError, RecursionError) as e:
        raise MalformedAnswer(f"the answer is not JSON: {str(e)[:120]}") from None
    return check_answer(obj)


def parse_completion(raw: bytes | str) -> dict[str, Any]:
    """A node's whole (non-streamed) answer of status 200: checked, and with choices."""
    obj = parse_answer(raw)
    if "error" in obj or not obj.get("choices"):
        raise MalformedAnswer("an answer of status 200 without choices")
    return obj


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _optional(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(key)
    if value is not None and not isinstance(value, kind):
        raise MalformedAnswer(f"{where}{key} is a {type(value).__name__}")
    return value


def check_answer(obj: Any) -> dict[str, Any]:
    """``obj`` if the proxy can read it as a completion answer or stream event; else
    ``MalformedAnswer`` naming the first field that is wrong."""
    if not isinstance(obj, dict):
        raise MalformedAnswer(f"the answer is a {type(obj).__name__}, not an object")
    if "error" in obj:
        return obj  # passed on to the client as the node's error
    choices = _optional(obj, "choices", list, "")
    _optional(obj, "usage", dict, "")
    kv = _optional(obj, "kv_transfer_params", dict, "")
    if kv is not None and kv.get("first_token") is not None and not _int(kv["first_token"]):
        raise MalformedAnswer("kv_transfer_params.first_token is not an integer")
    for i, choice in enumerate(choices or ()):
        where = f"choices[{i}]."
        if not isinstance(choice, dict):
            raise MalformedAnswer(f"choices[{i}] is a {type(choice).__name__}")
        ids = _optional(choice, "token_ids", list, where)
        if ids is not None and not all(_int(t) for t in ids):
            raise MalformedAnswer(f"{where}token_ids holds a non-integer")
        _optional(choice, "text", str, where)
        _optional(choice, "finish_reason", str, where)
        for key in ("delta", "message"):
            if key in choice and not isinstance(choice[key], dict):  # null too: never sent
                raise MalformedAnswer(f"{where}{key} is a {type(choice[key]).__name__}")
            if key in choice:
                _optional(choice[key], "content", str, f"{where}{key}.")
    return obj
