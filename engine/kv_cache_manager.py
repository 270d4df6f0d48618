"""Block tables per request, on top of the block pool.

The scheduler asks three questions here and never sees a ``KVBlock``:
which of a new request's tokens are already cached, can this request get
slots for N more tokens, and free this request. This class owns every
request's block table; anyone else asks for the ids (``block_ids``).

Block table of a request with block_size 4 and 10 tokens::

    tokens   0 1 2 3 | 4 5 6 7 | 8 9 . .
    table    [  17   ,   3     ,  42    ]   <- block ids, append-only
    slot of token i = table[i // 4] * 4 + i % 4
"""

from __future__ import annotations

from engine.block_pool import BlockPool, KVBlock
from engine.host_kv_tier import HostKVTier
from engine.prefix_hash import block_preimage, hash_blocks
from engine.prefix_hash import hash_block as hash_block  # re-exported: tests chain digests
from engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks: dict[str, list[KVBlock]] = {}
        # How many of each request's blocks are published to the prefix cache.
        self._num_cached: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        self.host_tier: HostKVTier | None = None  # attach_host_tier

    def attach_host_tier(self, tier: HostKVTier) -> None:
        """Keep evicted cached blocks in ``tier`` and serve prefix hits from it."""
        self.host_tier = tier
        self.pool.on_evict = lambda b: tier.save(b.block_id, b.block_hash, b.preimage)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a request that has computed nothing.

        At least the last token is always left to compute, since its logits
        are needed. Does not take references: pass the blocks to
        ``allocate_slots`` in the same scheduling step.
        """
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return [], 0
        self._update_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        parent = None
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            tokens = request.token_ids[i * self.block_size : (i + 1) * self.block_size]
            preimage = block_preimage(parent, tokens)
            block = self.pool.lookup(block_hash, preimage)
            if block is None:
                block = self._restore_from_host(block_hash, preimage, hits)
            if block is None:
                break
            hits.append(block)
            parent = block_hash
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def _restore_from_host(self, block_hash: bytes, preimage: bytes,
                           hits: list[KVBlock]) -> KVBlock | None:
        """A block the host tier kept, copied into a new device block that is
        then published and left free, like any cached block (no reference
        taken). None on a miss or when no device block is free."""
        tier = self.host_tier
        if tier is None or not tier.contains(block_hash, preimage):
            return None
        if self.pool.num_free_blocks <= sum(1 for b in hits if b.ref_cnt == 0):
            return None  # the only free blocks are this prefix's own hits
        self.pool.touch(hits)  # so that allocate() cannot hand one of them out
        try:
            (block,) = self.pool.allocate(1)
            if not tier.contains(block_hash, preimage):
                # Making room evicted a device block into the tier, which
                # pushed this one out (a tier of a single slot): a miss.
                self.pool.free([block])
                return None
            tier.restore(block_hash, block.block_id)
            self.pool.cache(block, block_hash, preimage)
            self.pool.free([block])
        finally:
            self.pool.free(list(reversed(hits)))
        return block

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
        cache_new_blocks: bool = True,
    ) -> bool:
        """Make room for ``num_new_tokens`` past the computed ones. Returns
        False, changing nothing, when there are not enough free blocks.

        With ``cache_new_blocks`` the blocks that these tokens fill are
        published to the prefix cache at once: their KV is written before any
        attention reads it in the same forward pass. A decode worker passes
        False for KV that is still arriving and calls ``cache_blocks`` later.
        """
        computed_blocks = computed_blocks or []
        held = self._blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(held) - len(
            computed_blocks
        )
        if num_needed <= 0 and not computed_blocks:  # a decode with room in its last block
            if cache_new_blocks:
                self.cache_blocks(request, num_computed + num_new_tokens)
            return True
        # Cache hits that sit in the free queue stop being free once touched.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return False
        self.pool.touch(computed_blocks)
        blocks = self._blocks.setdefault(request.request_id, [])
        last = blocks[-1] if blocks else computed_blocks[-1] if computed_blocks else None
        # The table grows at its end: the blocks after its last one, if free, keep it one run.
        new = self.pool.allocate(max(num_needed, 0), None if last is None else last.block_id)
        blocks.extend(computed_blocks)
        blocks.extend(new)
        if cache_new_blocks:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks among its first ``num_tokens``."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        # NOTE: from the first block not yet published, not from 0: every
        # decode step calls this, and a walk over the whole table would make
        # each step cost O(context).
        done = self._num_cached.get(request.request_id, 0)
        if num_full <= done:
            return
        self._update_hashes(request, num_full * self.block_size)
        blocks = self._blocks[request.request_id]
        hashes, bs = request.block_hashes, self.block_size
        for i in range(done, num_full):
            preimage = block_preimage(hashes[i - 1] if i else None,
                                      request.token_ids[i * bs : (i + 1) * bs])
            self.pool.cache(blocks[i], hashes[i], preimage)
        self._num_cached[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past those its first ``num_tokens``
        tokens fill: slots given to speculative tokens that were rejected.
        Such blocks were never published (``cache_blocks`` stops at the
        request's own tokens) nor shared (``fork`` shares prompt blocks)."""
        blocks = self._blocks.get(request.request_id)
        keep = self.num_blocks_for(num_tokens)
        if blocks and len(blocks) > keep:
            surplus = blocks[keep:]
            del blocks[keep:]
            self.pool.free(list(reversed(surplus)))

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Share the parent's first ``num_tokens // block_size`` blocks with a
        child that has none yet (``n > 1``: the completions share the prompt)."""
        shared = self._blocks[parent.request_id][: num_tokens // self.block_size]
        self.pool.touch(shared)
        self._blocks[child.request_id] = list(shared)
        child.num_computed_tokens = len(shared) * self.block_size

    def free(self, request: Request) -> None:
        """Return all of a request's blocks. Safe to call twice."""
        blocks = self._blocks.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if blocks:
            self.pool.free(list(reversed(blocks)))

    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Blocks for the first ``num_tokens`` tokens of a request that holds
        none, whose KV is written from outside (a prefill worker). They are
        not published to the prefix cache until ``cache_blocks``: until then
        they hold nothing another request may read. False, changing
        nothing, when there is no room."""
        needed = self.num_blocks_for(num_tokens)
        if request.request_id in self._blocks or needed > self.pool.num_free_blocks:
            return False
        self._blocks[request.request_id] = self.pool.allocate(needed)
        return True

    def num_held(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block table from entry ``start`` on (a new list)."""
        return [b.block_id for b in self._blocks.get(request_id, ())[start:]]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after a failed step: published blocks
        may never have been written), the host tier's copies too."""
        self.pool.reset_prefix_cache()
        if self.host_tier is not None:
            self.host_tier.clear()

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend the request's chained block digests to its full blocks
        among the first ``num_tokens`` tokens (engine/prefix_hash.py)."""
        bs = self.block_size
        hashes = request.block_hashes
        start, end = len(hashes) * bs, num_tokens // bs * bs
        if end > start:
            hashes.extend(hash_blocks(hashes[-1] if hashes else None,
                                      request.token_ids[start:end], bs))
