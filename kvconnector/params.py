"""``KVTransferParams``: the P/D parameters of one request, typed and validated once.

A request enters a node with a JSON object ``kv_transfer_params`` (set by the proxy, or by
an offline caller); ``KVTransferParams.from_dict`` parses it there -- the node's HTTP layer
(``engine.server.protocol``) or the caller that builds a ``Request`` -- and the typed
object travels on ``Request.kv_transfer_params``. ``to_dict`` writes it back for the wire
with the same JSON keys. Torch-free: the proxy imports it.

Keys a node accepts (proxy -> node):

* ``do_remote_decode`` -- the prefill leg: prefill, sample the first token, hold the
  prompt's blocks until they were pushed to the decode node that reserves them.
* ``do_remote_prefill`` -- the decode leg: the prompt's KV comes from the prefill node
  whose side channel is ``remote_side_channel`` (``tcp://host:port``).
* ``transfer_id`` -- pairs the two legs; one per request and attempt (the proxy makes a
  fresh one for each). Required on the decode leg; a prefill leg without it uses its
  engine request id, unique per request, and answers with it.
* ``skip_first_token`` -- decode leg: leave the first token out of the answer (the proxy
  already streamed it from the prefill node).

Keys a prefill node answers with (on the final output of a ``do_remote_decode`` request):
``transfer_id``, ``first_token``, ``remote_engine_id``, ``remote_side_channel``, and
``num_cached_tokens`` -- the prompt tokens P's prefix cache held (P computed the rest; the
proxy puts it in the client's ``usage.prompt_tokens_details``: docs/api.md). Added
without a version: optional both ways (a proxy that does not know it ignores it; without
it the proxy leaves D's usage as D wrote it). A decode leg may carry it back (vLLM's toy
proxy sends P's answer's params on); the node ignores it there, and drops a value that is
not a non-negative integer with a warning instead of refusing the request.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

PARAM = "kv_transfer_params"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# A transfer id names a transfer on the side channel, where knowing it is what lets a
# peer reserve or cancel it: the proxy makes each one with 48 random bits.
MAX_TRANSFER_ID_CHARS = 256

# field name -> (check, what it must be); every field is optional.
_CHECKS: dict[str, tuple[Any, str]] = {
    "do_remote_decode": (lambda v: isinstance(v, bool), "a boolean"),
    "do_remote_prefill": (lambda v: isinstance(v, bool), "a boolean"),
    "transfer_id": (
        lambda v: isinstance(v, str) and 0 < len(v) <= MAX_TRANSFER_ID_CHARS,
        f"a non-empty string of at most {MAX_TRANSFER_ID_CHARS} characters",
    ),
    "remote_side_channel": (
        lambda v: isinstance(v, str) and v.startswith("tcp://") and len(v) <= 512,
        "the prefill node's side-channel address (tcp://host:port)",
    ),
    "remote_engine_id": (lambda v: isinstance(v, str) and len(v) <= 512, "a string"),
    "first_token": (lambda v: _is_int(v) and v >= 0, "a non-negative integer (a token id)"),
    "skip_first_token": (lambda v: isinstance(v, bool), "a boolean"),
    "num_cached_tokens": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
}
# Facts a prefill node reports, not instructions: a bad value is dropped, not refused.
_REPORTED = frozenset({"num_cached_tokens"})


def _error(message: str, field: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, f"{PARAM}.{field}" if field else PARAM)


@dataclass(frozen=True)
class KVTransferParams:
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str | None = None
    remote_side_channel: str | None = None
    remote_engine_id: str | None = None
    first_token: int | None = None
    skip_first_token: bool = False
    num_cached_tokens: int | None = None

    def __post_init__(self) -> None:
        for name, (ok, what) in _CHECKS.items():
            value = getattr(self, name)
            if value is not _DEFAULTS[name] and not ok(value):
                raise _error(f"'{PARAM}.{name}' must be {what}, got {value!r:.60}", name)
        if self.do_remote_decode and self.do_remote_prefill:
            raise _error(
                f"'{PARAM}' cannot set both do_remote_decode and do_remote_prefill",
                "do_remote_prefill",
            )
        if self.do_remote_prefill and self.remote_side_channel is None:
            raise _error(
                f"'{PARAM}.remote_side_channel' is required with do_remote_prefill: the "
                "prefill node's side-channel address (tcp://host:port)",
                "remote_side_channel",
            )
        if self.do_remote_prefill and self.transfer_id is None:
            raise _error(
                f"'{PARAM}.transfer_id' is required with do_remote_prefill: the id the "
                "prefill leg was given (or answered with)",
                "transfer_id",
            )

    @classmethod
    def from_dict(cls, raw: Any) -> KVTransferParams:
        """Parse the JSON value of ``kv_transfer_params``; ``InvalidRequestError`` names
        the bad field (``param`` is ``kv_transfer_params.<field>``)."""
        if not isinstance(raw, dict):
            raise _error(f"'{PARAM}' must be an object, got {type(raw).__name__}")
        for key in raw:
            if key not in _CHECKS:
                known = ", ".join(_CHECKS)
                raise _error(f"'{PARAM}.{key}' is not a known field (known: {known})", str(key))
        # None stands for "absent", as JSON null does.
        fields = {k: v for k, v in raw.items() if v is not None}
        for key in _REPORTED & fields.keys():
            ok, what = _CHECKS[key]
            if not ok(fields[key]):
                logger.warning("%s.%s is not %s (%.60r): ignored", PARAM, key, what, fields[key])
                del fields[key]
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """The wire form: only the fields that are set (not None, not False)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and value is not False:
                out[f.name] = value
        return out

    @property
    def disaggregated(self) -> bool:
        """This request is one leg of a P/D pair (needs a KV connector)."""
        return self.do_remote_decode or self.do_remote_prefill


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(KVTransferParams)}
