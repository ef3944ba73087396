"""KV block pool: free list, reference counts and the prefix-cache hash table."""

from __future__ import annotations

from collections import OrderedDict

from engine.core.block_hash import BlockKey


class BlockPool:
    """Owns the ids ``0 .. num_blocks-1`` of one node's KV cache (same ids on every rank).

    A block is *free* when its reference count is 0. Free blocks that hold a cached prefix
    stay in the hash table until they are reused (LRU order), so a later request with the
    same prefix can take them back.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        # Free blocks in eviction order (oldest first); value unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_of: dict[int, BlockKey] = {}  # block id -> content hash
        self._block_of: dict[BlockKey, int] = {}  # content hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (evicting cached content) or raise if too few."""
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def lookup(self, content_hash: BlockKey) -> int | None:
        return self._block_of.get(content_hash) if self.enable_caching else None

    def touch(self, block: int) -> None:
        """Take a reference on a (possibly free) cached block."""
        if self.ref_cnt[block] == 0:
            del self._free[block]
        self.ref_cnt[block] += 1

    def free(self, blocks: list[int]) -> None:
        # Free in reverse so the tail of a sequence is evicted before its head.
        for block in reversed(blocks):
            assert self.ref_cnt[block] > 0, f"double free of block {block}"
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self._free[block] = None

    def cache(self, block: int, content_hash: BlockKey) -> None:
        """Record that ``block`` holds the full block whose prefix hash is ``content_hash``."""
        if not self.enable_caching or block in self._hash_of:
            return
        if content_hash in self._block_of:
            return  # another block already holds this content
        self._hash_of[block] = content_hash
        self._block_of[content_hash] = block

    def _evict(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
