"""The prefix cache's key for a full KV block: SHA-256 of the block's tokens chained with
the key of the block before it (the first block's with the request's ``cache_salt``).

A key stands for every token up to the block's end, so a hit hands one request KV that
another request computed: two different prefixes with the same key would give a request
KV of text it never sent -- another tenant's, where a client chooses its prompt to
collide. Python's ``hash()`` of a tuple of ints (the key before) is 64 bits and not made
to resist a chosen collision (it is an invertible mix of its items; an int's hash is its
value modulo 2**61 - 1, so parents that differ by that much hash alike); vLLM moved off it
for the same reason (CVE-2025-25183: prompts made to collide reused another prompt's
cached blocks; its ``--prefix-caching-hash-algo`` now offers SHA-256 and xxHash). A
SHA-256 key costs ~2 us per block of 16 tokens on this 2-core box (0.3 us for the tuple
hash): an 8k-token prompt ~1 ms, once per request (the chain is kept on the request).

The bytes hashed are unambiguous: a tag byte; for the first block the salt (its UTF-8
length, 4 bytes, then its bytes) when there is one; for the others the parent's 32-byte
digest; then the tokens as 8-byte little-endian integers.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

BlockKey = bytes  # a SHA-256 digest (32 bytes)

_FIRST, _FIRST_SALTED, _NEXT = b"\x00", b"\x01", b"\x02"
_BIG_ENDIAN = sys.byteorder == "big"


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("q", tokens)  # [num_tokens] int64
    if _BIG_ENDIAN:  # the same bytes on every host
        arr.byteswap()
    return arr.tobytes()


def block_key(parent: BlockKey | None, tokens: Sequence[int], salt: str | None = None) -> BlockKey:
    """The key of a full block holding ``tokens`` after the block keyed ``parent`` (None:
    the request's first block, which alone takes the ``salt``)."""
    if parent is not None:
        return hashlib.sha256(_NEXT + parent + _token_bytes(tokens)).digest()
    if salt is None:
        return hashlib.sha256(_FIRST + _token_bytes(tokens)).digest()
    raw = salt.encode("utf-8", "surrogatepass")
    head = _FIRST_SALTED + struct.pack("<I", len(raw)) + raw
    return hashlib.sha256(head + _token_bytes(tokens)).digest()
