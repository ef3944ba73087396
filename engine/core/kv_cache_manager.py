"""Maps requests to KV blocks: allocation, prefix-cache lookup, freeing; and which full
prompt blocks the steps not yet finished are computing (``computing`` / ``step_done``), so
a request sharing them can wait for them rather than compute them a second time."""

from __future__ import annotations

from collections import Counter

from engine.core.block_hash import BlockKey, block_key
from engine.core.block_pool import BlockPool
from engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[int]] = {}
        # Per request: how many of its leading blocks were offered to the prefix cache, so
        # each step registers only the blocks that became full since (not the whole table).
        self._num_cached: dict[str, int] = {}
        # Per request: how many of its blocks the workers were sent (``blocks_to_send``).
        self._num_sent: dict[str, int] = {}
        # Per step not finished yet: the hashes of the full prompt blocks it computes
        # (each a prefix-cache entry once the step is done), and how many such steps
        # compute each hash.
        self._in_flight: dict[int, list[BlockKey]] = {}
        self._in_flight_count: Counter[BlockKey] = Counter()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _hash_chain(self, request: Request, num_full_blocks: int) -> list[BlockKey]:
        """Block ``i``'s key stands for the tokens up to its end: its tokens chained with
        block ``i - 1``'s key; the first block's with the request's ``cache_salt`` (vLLM's
        rule), so a salted chain shares no key with another salt's or an unsalted one
        (``engine/core/block_hash.py``: SHA-256, a chosen collision is out of reach)."""
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            tokens = request.all_token_ids[i * bs : (i + 1) * bs]
            parent = hashes[-1] if hashes else None
            hashes.append(block_key(parent, tokens, request.cache_salt))
        return hashes  # at least num_full_blocks long

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Longest cached prefix of full blocks; always leaves >= 1 token to compute."""
        if not self.pool.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        out = []
        for h in self._hash_chain(request, max_blocks)[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            out.append(block)
        return out

    def computing(self, step: int, request: Request, start: int, end: int) -> None:
        """Step ``step`` computes the request's tokens ``[start, end)``: the full prompt
        blocks it completes are in flight until ``step_done(step)``."""
        if not self.pool.enable_caching or start >= request.num_prompt_tokens:
            return
        first, last = (
            start // self.block_size,
            min(end, request.num_prompt_tokens) // self.block_size,
        )
        if last <= first:
            return
        hashes = self._hash_chain(request, last)[first:last]
        self._in_flight.setdefault(step, []).extend(hashes)
        self._in_flight_count.update(hashes)

    def step_done(self, step: int) -> None:
        """The step's blocks are cached now, or never will be (their request ended)."""
        for h in self._in_flight.pop(step, ()):
            self._in_flight_count[h] -= 1
            if not self._in_flight_count[h]:
                del self._in_flight_count[h]

    def forget_steps_in_flight(self) -> None:
        self._in_flight.clear()
        self._in_flight_count.clear()

    def num_blocks_in_flight(self, request: Request, num_cached_blocks: int) -> int:
        """How many of the full blocks right after the request's cached prefix (its first
        ``num_cached_blocks``) a step not finished yet computes for another request."""
        if not self._in_flight_count:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size  # >= 1 token to compute
        n = 0
        for h in self._hash_chain(request, max_blocks)[num_cached_blocks:max_blocks]:
            if h not in self._in_flight_count:
                break
            n += 1
        return n

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; ``None`` if the pool is too full.

        ``computed_blocks`` (first allocation only) are prefix-cache hits to take first.
        """
        computed_blocks = computed_blocks or []
        have = self._blocks.get(request.request_id, [])
        total = len(have) + len(computed_blocks)
        target = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        need = max(0, target - total)
        reclaimed = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_free - reclaimed:
            return None
        for b in computed_blocks:
            self.pool.touch(b)
        blocks = self._blocks.setdefault(request.request_id, [])
        blocks.extend(computed_blocks)
        if need:
            # after its last block: a request allocated a few blocks at a time (chunked
            # prefill, decode growth) continues its run of ids where the next ones are free
            blocks.extend(self.pool.allocate(need, blocks[-1] if blocks else None))
        return blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.pool.enable_caching:
            return
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        rid = request.request_id
        done = self._num_cached.get(rid, 0)
        # Known tokens only: a step in flight may compute one whose id is not known yet.
        computed = min(request.num_computed_tokens, request.num_tokens)
        n_full = min(computed // self.block_size, len(blocks))
        if n_full <= done:
            return
        hashes = self._hash_chain(request, n_full)
        for i in range(done, n_full):
            self.pool.cache(blocks[i], hashes[i])
        self._num_cached[rid] = n_full

    def blocks_to_send(self, request_id: str) -> tuple[list[int], bool, int]:
        """The request's blocks the workers have not been sent yet, whether they make a new
        table (the first send since these blocks were allocated), and the table's length.
        Called once per step the request is scheduled in."""
        blocks = self._blocks[request_id]
        sent = self._num_sent.get(request_id)
        self._num_sent[request_id] = len(blocks)
        if sent is None:
            return list(blocks), True, len(blocks)
        return blocks[sent:], False, len(blocks)

    def _forget(self, request_id: str) -> None:
        self._num_cached.pop(request_id, None)
        self._num_sent.pop(request_id, None)

    def detach(self, request_id: str) -> list[int]:
        """Take the request's blocks away without freeing them (the caller owns them)."""
        self._forget(request_id)
        return self._blocks.pop(request_id, [])

    def free(self, request_id: str) -> None:
        self._forget(request_id)
        blocks = self._blocks.pop(request_id, None)
        if blocks:
            self.pool.free(blocks)
