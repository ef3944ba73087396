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

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take ``n`` free blocks (evicting cached content) or raise if too few.

        Which blocks: the ``n`` least recently freed (LRU), except that a free block that
        holds no cached content may stand in for one -- taking it evicts nothing, so the
        cached content an allocation evicts is always the oldest in LRU order and never
        more than LRU alone would evict. Such blocks are taken to lengthen runs of
        consecutive ids: after each block taken from the LRU list, the ids right above it
        while they are free and hold nothing; and first, when ``after`` (the requesting
        sequence's last block) is given, the ids right above it, so a sequence allocated a
        few blocks at a time continues its run.

        Order: the run continuing ``after`` first, then the rest ascending. A KV push
        moves each run of consecutive ids (on both nodes) as one NIXL descriptor
        (``kvconnector/nixl/block_runs.py``); the LRU list alone, a sequence's blocks freed
        tail first, handed them out in descending order: one descriptor per block.
        """
        free = self._free
        if n > len(free):
            raise MemoryError(f"need {n} KV blocks, {len(free)} free")
        # Inline, no call per block: the scheduler allocates every step.
        hash_of, block_of, ref_cnt = self._hash_of, self._block_of, self.ref_cnt
        out: list[int] = []
        if after is not None:
            block = after + 1
            while len(out) < n and block in free and block not in hash_of:
                del free[block]
                ref_cnt[block] = 1
                out.append(block)
                block += 1
        continued = len(out)
        while len(out) < n:
            block, _ = free.popitem(last=False)  # the least recently freed
            content = hash_of.pop(block, None)
            if content is not None:
                del block_of[content]  # evicted from the prefix cache
            ref_cnt[block] = 1
            out.append(block)
            block += 1
            while len(out) < n and block in free and block not in hash_of:
                del free[block]
                ref_cnt[block] = 1
                out.append(block)
                block += 1
        if continued == 0:
            out.sort()
        elif continued < n:
            rest = out[continued:]
            rest.sort()
            out[continued:] = rest
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
