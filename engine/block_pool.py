"""Ref-counted KV blocks, an O(1) LRU free queue, and the prefix-cache map.

A block is *free* when no request holds it (``ref_cnt == 0``); a free block
may still hold a cached prefix (``block_hash`` set) and can be revived by a
cache hit until it is handed out again. A cached block keeps the bytes its
digest was computed from, and a hit must match them too (engine/prefix_hash.py).

Free blocks live in one of two places:

    free_runs    cache nothing: handed out first, by address, in runs of
                 consecutive ids (engine/free_runs.py)
    free_queue   cache a prefix: evicted only when no other block is free,
                 least recently freed first, so cached prefixes survive as
                 long as possible

A request's new blocks come back in ascending id order (after ``after``,
when given), so that blocks taken together are consecutive in the table
wherever their ids are: a KV transport then moves a request's cache as a
few long ranges, not block by block.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.free_runs import FreeRuns


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "preimage", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is in the prefix cache: its chained digest, and
        # the parent digest + packed token ids that digest was computed from.
        self.block_hash: bytes | None = None
        self.preimage: bytes | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={digest})"


class FreeBlockQueue:
    """A doubly linked list of blocks: popleft, append and remove in O(1).

    ``remove`` is what a plain deque cannot do cheaply: a cache hit takes a
    block out of the middle of the queue.
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        block.prev, block.next = last, self._tail
        last.next = self._tail.prev = block
        self._len += 1

    def popleft(self) -> KVBlock:
        if self._len == 0:
            raise IndexError("no free blocks")
        block = self._head.next
        assert block is not None
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, "block not in the queue"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self._len -= 1

    def block_ids(self) -> list[int]:
        """Free block ids from head to tail (for tests and debugging)."""
        out, node = [], self._head.next
        while node is not self._tail:
            assert node is not None
            out.append(node.block_id)
            node = node.next
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_runs = FreeRuns(num_blocks)  # free, caching nothing
        self.free_queue = FreeBlockQueue([])  # free, caching a prefix: LRU
        self._cached: dict[bytes, KVBlock] = {}
        # Called with each cached block just before allocate() hands it to a
        # new owner (the host KV tier keeps its bytes); None: dropped.
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_runs) + len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0.0 - 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int, after: int | None = None) -> list[KVBlock]:
        """Take ``n`` blocks: those that cache nothing first, in as few runs
        of consecutive ids as there are (the ids right after ``after``
        first, if free), then cached ones, evicting their prefixes least
        recently freed first. Ascending ids, from ``after + 1`` round when
        ``after`` is given."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        clean = min(n, len(self.free_runs))
        out = [self.blocks[i] for i in self.free_runs.take(clean, after)]
        for _ in range(n - clean):
            block = self.free_queue.popleft()
            if self.on_evict is not None:
                self.on_evict(block)
            self._evict(block)
            out.append(block)
        for block in out:
            block.ref_cnt = 1
        # NOTE: the order of new blocks in a table is free to choose (they
        # hold nothing yet); by id, a set of neighbours is one run.
        first = 0 if after is None else after + 1
        out.sort(key=lambda b: (b.block_id - first) % self.num_blocks)
        return out

    def lookup(self, block_hash: bytes, preimage: bytes | None = None) -> KVBlock | None:
        """The cached block of this digest, if it holds the same content: its
        digest and, when ``preimage`` is given (the KV cache manager always
        gives it), the bytes the digest was computed from must be equal, so a
        colliding key is a miss."""
        block = self._cached.get(block_hash)
        if block is None or block.block_hash != block_hash:
            return None
        if preimage is not None and block.preimage != preimage:
            return None
        return block

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference on each block (a cache hit or a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._unfree(block)
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; those that reach zero join the
        free runs, or, when they cache a prefix, the free queue in the given
        order (pass a request's blocks tail first so the end of a prefix is
        evicted before its start)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed twice"
            if block.ref_cnt == 0:
                self._refree(block)

    def cache(self, block: KVBlock, block_hash: bytes, preimage: bytes) -> None:
        """Publish a full block under its chained digest, keeping the bytes
        the digest was computed from for lookups to compare."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            # An identical block is cached already (or, were the digest ever
            # to collide, a different one: lookups tell them apart by the
            # preimage); keep the first one.
            return
        if block.ref_cnt == 0:
            self._unfree(block)  # NOTE: callers publish held blocks; kept correct anyway
        block.block_hash = block_hash
        block.preimage = preimage
        self._cached[block_hash] = block
        if block.ref_cnt == 0:
            self._refree(block)

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            free = block.ref_cnt == 0
            if free:
                self._unfree(block)
            self._evict(block)
            if free:
                self._refree(block)

    def free_block_ids(self) -> tuple[list[int], list[int]]:
        """(free blocks caching nothing, ascending; free cached blocks in
        eviction order), for tests and debugging."""
        return self.free_runs.block_ids(), self.free_queue.block_ids()

    def _unfree(self, block: KVBlock) -> None:
        """Take a free block out of wherever it waits."""
        if block.block_hash is not None:
            self.free_queue.remove(block)
        else:
            self.free_runs.discard(block.block_id)

    def _refree(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            self.free_queue.append(block)
        else:
            self.free_runs.add(block.block_id)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = block.preimage = None
