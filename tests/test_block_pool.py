"""BlockPool, FreeBlockQueue and KVCacheManager on the CPU,
asserting exact block ids: allocation and free order, runs of consecutive
blocks, LRU eviction of cached prefixes, ref counts, chained prefix hashes."""

from __future__ import annotations

import time

import pytest

from engine.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine.kv_cache_manager import KVCacheManager, hash_block
from engine.prefix_hash import block_preimage
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, list(tokens), SamplingParams(**params))


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def digest(n: int) -> bytes:
    """The digest of a one-block prompt ``[n]``: a key for the pool tests."""
    return hash_block(None, [n])


def cache(pool: BlockPool, block: KVBlock, n: int) -> None:
    pool.cache(block, digest(n), block_preimage(None, [n]))


def ref_counts(kv: KVCacheManager, ids: list[int]) -> list[int]:
    return [kv.pool.blocks[i].ref_cnt for i in ids]


# ---- FreeBlockQueue -----------------------------------------------------------


def test_free_queue_order_and_remove_from_middle():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and len(q) == 4
    assert blocks[2].prev is None and blocks[2].next is None
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert q.block_ids() == [1, 3]
    assert q.popleft() is blocks[1]
    q.append(blocks[2])
    assert q.block_ids() == [3, 2]
    assert [q.popleft().block_id, q.popleft().block_id] == [3, 2]
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_remove_is_constant_time():
    # Removing every other block of a long queue: linear-time removal
    # (deque.remove) would be ~n^2/4 = 2.5e9 steps here.
    n = 100_000
    blocks = [KVBlock(i) for i in range(n)]
    q = FreeBlockQueue(blocks)
    t = time.perf_counter()
    for block in blocks[n // 4 : 3 * n // 4 : 2]:
        q.remove(block)
    assert time.perf_counter() - t < 1.0
    assert len(q) == n - n // 4
    ids = q.block_ids()
    assert ids[: n // 4] == list(range(n // 4)) and ids[n // 4] == n // 4 + 1


# ---- BlockPool ------------------------------------------------------------------


def test_pool_hands_out_uncached_blocks_by_address():
    pool = BlockPool(5)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1] and [b.ref_cnt for b in a] == [1, 1]
    assert pool.free_block_ids() == ([2, 3, 4], []) and pool.num_free_blocks == 3
    pool.free(list(reversed(a)))
    assert pool.free_block_ids() == ([0, 1, 2, 3, 4], [])  # one run again
    assert [b.block_id for b in pool.allocate(4)] == [0, 1, 2, 3]
    assert pool.usage == pytest.approx(0.8)
    with pytest.raises(ValueError):
        pool.allocate(2)


def test_pool_evicts_cached_blocks_in_lru_order():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for b, h in zip(blocks, (10, 11, 12, 13)):
        cache(pool, b, h)
    pool.free([blocks[3], blocks[1], blocks[0], blocks[2]])  # free order = eviction order
    assert pool.free_block_ids() == ([], [3, 1, 0, 2])
    assert all(pool.lookup(digest(h)) is not None for h in (10, 11, 12, 13))
    got = pool.allocate(2)
    assert [b.block_id for b in got] == [1, 3]  # the first two to evict, by id
    assert pool.lookup(digest(13)) is None and pool.lookup(digest(11)) is None  # evicted
    assert pool.lookup(digest(10)) is blocks[0] and pool.lookup(digest(12)) is blocks[2]
    assert got[0].block_hash is None


def test_pool_touch_revives_a_free_cached_block_and_counts_refs():
    pool = BlockPool(3)
    b0, b1, _ = pool.allocate(3)
    cache(pool, b1, 7)
    pool.free([b1, b0])
    assert pool.free_block_ids() == ([0], [1])
    hit = pool.lookup(digest(7))
    pool.touch([hit])  # out of the free queue
    assert hit is b1 and b1.ref_cnt == 1 and pool.free_block_ids() == ([0], [])
    pool.touch([b1])
    assert b1.ref_cnt == 2
    pool.free([b1])
    assert b1.ref_cnt == 1 and pool.free_block_ids() == ([0], [])
    pool.free([b1])
    assert pool.free_block_ids() == ([0], [1]) and pool.lookup(digest(7)) is b1


def test_pool_keeps_the_first_of_two_identical_blocks():
    pool = BlockPool(2)
    b0, b1 = pool.allocate(2)
    cache(pool, b0, 5)
    cache(pool, b1, 5)
    assert pool.lookup(digest(5)) is b0 and b1.block_hash is None
    pool.reset_prefix_cache()
    assert pool.lookup(digest(5)) is None and b0.block_hash is None and b0.preimage is None


def test_pool_hit_needs_the_same_preimage():
    pool = BlockPool(2)
    b0, _ = pool.allocate(2)
    cache(pool, b0, 5)
    assert pool.lookup(digest(5), block_preimage(None, [5])) is b0
    assert pool.lookup(digest(5), block_preimage(None, [6])) is None  # same key, other content
    assert pool.lookup(digest(5), block_preimage(digest(4), [5])) is None  # other parent


def test_pool_with_caching_off_caches_nothing():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    cache(pool, b, 5)
    assert pool.lookup(digest(5)) is None and b.block_hash is None


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0)


# ---- KVCacheManager -------------------------------------------------------------


def test_allocate_slots_grows_the_table_append_only():
    kv = KVCacheManager(8, BS)
    a = req("a", toks(100, 10))
    assert kv.allocate_slots(a, 10)
    assert kv.block_ids(a.request_id) == [0, 1, 2] and kv.num_free_blocks == 5
    a.num_computed_tokens = 10
    a.append_token(1)
    assert kv.allocate_slots(a, 1)  # token 10 fits in block 2
    assert kv.block_ids(a.request_id) == [0, 1, 2]
    a.num_computed_tokens = 11
    for t in (2, 3):
        a.append_token(t)
    assert kv.allocate_slots(a, 2)  # tokens 11, 12: block 3 opens
    assert kv.block_ids(a.request_id) == [0, 1, 2, 3] and kv.num_held("a") == 4


def test_full_blocks_are_published_with_chained_hashes():
    kv = KVCacheManager(8, BS)
    a = req("a", toks(100, 10))
    kv.allocate_slots(a, 10)
    h0 = hash_block(None, toks(100, 4))
    h1 = hash_block(h0, toks(104, 4))
    assert a.block_hashes == [h0, h1]  # the partial third block has no hash
    assert kv.pool.lookup(h0).block_id == 0 and kv.pool.lookup(h1).block_id == 1
    assert kv.pool.blocks[2].block_hash is None


def test_prefix_hit_shares_blocks_and_counts_refs():
    kv = KVCacheManager(8, BS)
    a = req("a", toks(100, 10))
    kv.allocate_slots(a, 10)
    b = req("b", toks(100, 8) + [7, 7, 7])
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert kv.allocate_slots(b, 3, hits)
    assert kv.block_ids(b.request_id) == [0, 1, 3]
    assert ref_counts(kv, [0, 1, 2, 3]) == [2, 2, 1, 1]
    kv.free(a)
    assert ref_counts(kv, [0, 1, 2]) == [1, 1, 0] and kv.block_ids(a.request_id) == []
    assert kv.pool.free_block_ids() == ([2, 4, 5, 6, 7], [])
    kv.free(b)
    # Tail first: the end of a prefix is evicted before its start.
    assert kv.pool.free_block_ids() == ([2, 3, 4, 5, 6, 7], [1, 0])
    kv.free(b)  # twice is harmless
    assert kv.num_free_blocks == 8


def test_a_differing_earlier_block_breaks_the_chain():
    kv = KVCacheManager(8, BS)
    kv.allocate_slots(req("a", toks(100, 12)), 12)
    # Block 1 holds the same tokens as a's block 1, but block 0 differs.
    c = req("c", [1, 2, 3, 4] + toks(104, 8))
    assert kv.get_computed_blocks(c) == ([], 0)
    # Same first block, second differs, third the same: only the first hits.
    d = req("d", toks(100, 4) + [9, 9, 9, 9] + toks(108, 4) + [5])
    hits, n = kv.get_computed_blocks(d)
    assert [h.block_id for h in hits] == [0] and n == 4


def test_the_last_token_is_never_a_cache_hit():
    kv = KVCacheManager(8, BS)
    kv.allocate_slots(req("a", toks(100, 12)), 12)
    # All 8 tokens are cached, but the last one must be computed for its logits.
    hits, n = kv.get_computed_blocks(req("b", toks(100, 8)))
    assert [h.block_id for h in hits] == [0] and n == 4
    hits, n = kv.get_computed_blocks(req("c", toks(100, 9)))
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert kv.prefix_queries == 17 and kv.prefix_hits == 12


def test_prompt_logprobs_requests_skip_the_cache():
    kv = KVCacheManager(8, BS)
    kv.allocate_slots(req("a", toks(100, 12)), 12)
    assert kv.get_computed_blocks(req("b", toks(100, 12), prompt_logprobs=0)) == ([], 0)


def test_freed_prefix_survives_until_its_blocks_are_reused():
    kv = KVCacheManager(5, BS)
    a = req("a", toks(100, 10))
    kv.allocate_slots(a, 10)  # blocks 0, 1 (cached), 2
    kv.free(a)
    assert kv.pool.free_block_ids() == ([2, 3, 4], [1, 0])
    d = req("d", toks(300, 16))
    assert kv.allocate_slots(d, 16)
    assert kv.block_ids(d.request_id) == [1, 2, 3, 4]  # block 1's prefix is evicted, block 0's is not
    hits, n = kv.get_computed_blocks(req("e", toks(100, 10)))
    assert [h.block_id for h in hits] == [0] and n == 4


def test_cache_switched_off():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = req("a", toks(100, 12))
    kv.allocate_slots(a, 12)
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.get_computed_blocks(req("b", toks(100, 12))) == ([], 0)
    kv.free(a)
    assert kv.pool.free_block_ids() == (list(range(8)), [])


def test_fork_shares_full_blocks():
    kv = KVCacheManager(8, BS)
    parent = req("p", toks(100, 10))
    kv.allocate_slots(parent, 10)
    child = Request("p#1", parent.prompt_token_ids, parent.params, index=1, parent_id="p")
    kv.fork(parent, child, 9)  # 9 tokens: 2 full blocks
    assert kv.block_ids(child.request_id) == [0, 1] and child.num_computed_tokens == 8
    assert ref_counts(kv, [0, 1, 2]) == [2, 2, 1]
    assert kv.allocate_slots(child, 2)  # tokens 8, 9 into its own block
    assert kv.block_ids(child.request_id) == [0, 1, 3]
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8 and ref_counts(kv, [0, 1, 2, 3]) == [0, 0, 0, 0]


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(3, BS)
    a = req("a", toks(100, 13))
    assert not kv.allocate_slots(a, 13)  # needs 4 blocks
    assert kv.num_free_blocks == 3 and kv.block_ids(a.request_id) == [] and kv.num_held("a") == 0
    assert kv.pool.free_block_ids() == ([0, 1, 2], [])
    assert not a.block_hashes or kv.pool.lookup(a.block_hashes[0]) is None


def test_failed_allocation_with_cache_hits_takes_no_reference():
    kv = KVCacheManager(4, BS)
    a = req("a", toks(100, 9))
    kv.allocate_slots(a, 9)  # blocks 0, 1 cached, 2
    kv.free(a)
    assert kv.pool.free_block_ids() == ([2, 3], [1, 0])
    # Hits on blocks 0 and 1 (free, cached); 9 more tokens need 3 more blocks,
    # but reviving the hits leaves only 2 free.
    b = req("b", toks(100, 8) + toks(500, 9))
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert not kv.allocate_slots(b, 9, hits)
    assert kv.pool.free_block_ids() == ([2, 3], [1, 0])
    assert ref_counts(kv, [0, 1, 2, 3]) == [0, 0, 0, 0] and kv.block_ids(b.request_id) == []
    # With one token fewer it fits exactly, using the revived blocks.
    c = req("c", toks(100, 8) + toks(500, 8))
    hits, n = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 8, hits)
    assert kv.block_ids(c.request_id) == [0, 1, 2, 3] and kv.num_free_blocks == 0


def test_allocate_without_publishing_then_cache_blocks():
    kv = KVCacheManager(4, BS)
    a = req("a", toks(100, 9))
    assert kv.allocate_slots(a, 9, cache_new_blocks=False)
    assert all(b.block_hash is None for b in kv.pool.blocks)
    kv.cache_blocks(a, 9)
    assert [kv.pool.blocks[i].block_hash is not None for i in range(3)] == [True, True, False]


def test_decode_steps_publish_each_block_as_it_fills():
    kv = KVCacheManager(8, BS)
    a = req("a", toks(100, 6))
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    assert [b.block_hash is not None for b in kv.pool.blocks[:2]] == [True, False]
    for token in (7, 8):  # tokens 6 and 7: block 1 fills with the second
        a.append_token(token)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert kv.block_ids(a.request_id) == [0, 1] and kv.pool.blocks[1].block_hash == a.block_hashes[1]
    # A prompt equal to a's tokens so far (plus one) hits both blocks.
    hits, n = kv.get_computed_blocks(req("b", a.token_ids + [9]))
    assert [h.block_id for h in hits] == [0, 1] and n == 8
