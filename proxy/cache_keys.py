"""OpenAI's ``prompt_cache_key`` as a routing affinity for ``--routing prefix``.

A client names the cache its requests should share (a conversation, a user, an agent's
session) even where their texts share little the proxy's text index could see (another
document after the same long system prompt, a history a client rewrote). OpenAI routes
requests with the same key to the same cache; here, to the same prefill and decode node.

``affinity`` is what a request's key is remembered by: a digest of the key and the
request's ``cache_salt`` (tenants' equal keys are routed independently, as their equal
prompts are; neither string is kept). ``KeyOwners`` remembers, per role, the node each key
was last routed to by the cache-aware rule (``proxy/router.py``'s ``CacheAware``): an LRU
of at most ``max_keys`` per role. A node that leaves rotation, leaves the pool or restarts
loses its keys (``drop``, from the router's reset hook): the key's next request is routed
by the rule again, and its node becomes the key's.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

# Per entry: a 16-byte digest, the URL (the node's own string) and the LRU's slot.
DIGEST_BYTES = 16


def affinity(cache_key: str | None, salt: str | None) -> bytes | None:
    """What a request's ``prompt_cache_key`` is remembered by (None: no key)."""
    if not cache_key:
        return None
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in (salt, cache_key):
        data = b"" if part is None else part.encode("utf-8", "surrogatepass")
        h.update(b"\x00" if part is None else b"\x01" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


class KeyOwners:
    """Per role, the URL of the node each key's requests go to: LRU, ``max_keys`` each."""

    def __init__(self, max_keys: int) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.max_keys = max_keys
        self._owners: dict[str, OrderedDict[bytes, str]] = {}
        self.evicted_total = 0

    def owner(self, role: str, key: bytes) -> str | None:
        """The URL ``key``'s requests of ``role`` go to (made the most recent), or None."""
        owners = self._owners.get(role)
        url = owners.get(key) if owners is not None else None
        if url is not None:
            owners.move_to_end(key)  # type: ignore[union-attr]
        return url

    def assign(self, role: str, key: bytes, url: str) -> None:
        owners = self._owners.setdefault(role, OrderedDict())
        owners[key] = url
        owners.move_to_end(key)
        if len(owners) > self.max_keys:
            owners.popitem(last=False)
            self.evicted_total += 1

    def drop(self, role: str, url: str) -> int:
        """Forget the keys of ``url`` (its node left rotation or restarted); how many."""
        owners = self._owners.get(role)
        if not owners:
            return 0
        gone = [k for k, u in owners.items() if u == url]
        for k in gone:
            del owners[k]
        return len(gone)

    def size(self, role: str) -> int:
        return len(self._owners.get(role) or ())
