"""The UCXX transport's wire format: a write's tag and header (``transport_ucxx.py`` sends
them, ``ucxx_receive.py`` takes them apart).

Each write is one 64-bit tag ``sender id (32 random bits per transport) << 32 | sequence``
and at most two messages with that tag, in order (UCX matches messages of one sender and
one tag in the order they were sent):

1. the header, a msgpack map ``{v, a, x, ts, n, nb, ids, h}``: protocol version, sender
   name, sequence, the sender's wall-clock time, the notification bytes, the data bytes
   that follow, D's block ids, and the head slice ``[first, count]`` of each (block,
   layer, kv) unit or null for whole blocks;
2. the data (absent when ``nb`` is 0): the blocks or head slices in ``ids`` order.

The receiver checks a header against its own cache (``parse_header``): ids in range and
distinct, slice inside its heads, ``nb`` equal to what they describe.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

PROTOCOL = 1
HEADER_MAX = 64 << 20  # a header larger than this is refused unread


@dataclass(frozen=True)
class BlockLayout:
    """A rank's KV blocks as a header describes them."""

    num_blocks: int
    block_bytes: int
    num_layers: int | None
    num_heads: int | None
    head_bytes: int  # bytes of one head in one (block, layer, kv) unit; 0: unknown


def write_tag(sender_id: int, seq: int) -> int:
    """The tag of a write's messages."""
    return (sender_id << 32) | seq


def pack_header(
    agent_name: str,
    seq: int,
    notif: bytes,
    nbytes: int,
    remote_ids: Sequence[int],
    heads: tuple[int, int] | None,
) -> bytes:
    """A write's header; ``heads``: the (first, count) head slice on the receiver."""
    return msgpack.packb(
        {
            "v": PROTOCOL,
            "a": agent_name,
            "ts": time.time(),
            "x": seq,
            "n": bytes(notif),
            "nb": nbytes,
            "ids": [int(i) for i in remote_ids],
            "h": None if heads is None else [heads[0], heads[1]],
        },
        use_bin_type=True,
    )


def parse_header(raw: bytes, layout: BlockLayout) -> tuple[dict[str, Any] | None, str | None]:
    """``(header, None)`` for a header that fits ``layout``, else ``(None, why)``."""
    try:
        h = msgpack.unpackb(raw, raw=False)
        if not isinstance(h, dict) or h.get("v") != PROTOCOL:
            return None, f"not a protocol-{PROTOCOL} header"
        notif, nb, ids, heads, sent = h["n"], h["nb"], h["ids"], h["h"], h["ts"]
    except Exception as exc:
        return None, f"malformed header: {exc!r}"
    if not isinstance(notif, bytes) or not isinstance(nb, int) or not isinstance(ids, list):
        return None, "malformed header fields"
    if not isinstance(sent, (int, float)):
        return None, "malformed header time"
    if not all(isinstance(i, int) and 0 <= i < layout.num_blocks for i in ids):
        return None, f"block ids out of range (this rank has {layout.num_blocks})"
    if len(set(ids)) != len(ids):
        return None, "repeated block ids"
    if heads is None:
        expect = len(ids) * layout.block_bytes
    else:
        ok = (
            isinstance(heads, list)
            and len(heads) == 2
            and all(isinstance(x, int) for x in heads)
            and layout.head_bytes > 0
            and layout.num_heads is not None
            and heads[1] >= 1
            and heads[0] >= 0
            and heads[0] + heads[1] <= layout.num_heads
        )
        if not ok:
            return None, f"head slice {heads!r} out of this rank's heads"
        assert layout.num_layers is not None
        expect = len(ids) * 2 * layout.num_layers * heads[1] * layout.head_bytes
    if nb != expect:
        return None, f"{nb} data bytes announced, the blocks hold {expect}"
    return {"n": notif, "nb": nb, "ids": ids, "h": heads, "ts": float(sent)}, None
