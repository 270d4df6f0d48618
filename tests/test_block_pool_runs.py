"""Runs of consecutive free blocks (FreeRuns), and the pool and KV cache
manager handing them out: exact ids, so that a request's blocks stay few
long ranges of the cache (what a KV transport moves as segments)."""

from __future__ import annotations

import random
import time

import pytest

from engine.block_pool import BlockPool
from engine.free_runs import FreeRuns
from engine.kv_cache_manager import KVCacheManager
from engine.prefix_hash import block_preimage, hash_block
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_runs_merge_on_both_sides():
    runs = FreeRuns(0)
    for i in (5, 3, 9, 4, 7):
        runs.add(i)
    assert runs.runs() == [(3, 3), (7, 1), (9, 1)] and len(runs) == 5
    runs.add(8)  # joins 7 and 9
    assert runs.runs() == [(3, 3), (7, 3)]
    assert 8 in runs and 6 not in runs and 2 not in runs and 10 not in runs


def test_free_runs_take_the_smallest_class_that_fits():
    runs = FreeRuns(0)
    for start, n in ((0, 9), (20, 2), (30, 4), (40, 1)):
        for i in range(start, start + n):
            runs.add(i)
    assert runs.take(1) == [40]  # a run of one
    assert runs.take(3) == [30, 31, 32]  # from the run of 4, not the 9
    assert runs.take(2) == [20, 21]
    assert runs.runs() == [(0, 9), (33, 1)]
    # Nothing holds 12: the longest run whole, then the rest.
    assert sorted(runs.take(10)) == [*range(9), 33]
    assert len(runs) == 0
    with pytest.raises(ValueError):
        runs.take(1)


def test_free_runs_take_after_continues_a_run_and_discard_splits():
    runs = FreeRuns(12)
    runs.discard(4)
    assert runs.runs() == [(0, 4), (5, 7)]
    assert runs.take(3, after=4) == [5, 6, 7]  # right after block 4
    assert runs.take(2, after=10) == [0, 1]  # 11 is free but inside a run: a fitting run instead
    with pytest.raises(KeyError):
        runs.discard(5)
    assert runs.runs() == [(2, 2), (8, 4)]


def test_free_runs_stay_maximal_under_random_use():
    rng = random.Random(0)
    n = 300
    runs, held = FreeRuns(n), set()
    for _ in range(2000):
        if held and rng.random() < 0.5:
            i = rng.choice(sorted(held))
            held.discard(i)
            runs.add(i)
        elif len(runs):
            got = runs.take(rng.randint(1, min(8, len(runs))), after=rng.choice([None, 5, 77]))
            assert not held & set(got)
            held |= set(got)
        spans = runs.runs()
        assert all(a + m < b for (a, m), (b, _) in zip(spans, spans[1:]))  # never touching
        assert set(runs.block_ids()) == set(range(n)) - held and len(runs) == n - len(held)


def test_free_runs_are_fast_for_single_blocks():
    n = 100_000
    runs = FreeRuns(n)
    t = time.perf_counter()
    got = [runs.take(1)[0] for _ in range(n // 2)]
    for i in got[::2]:
        runs.add(i)
    assert time.perf_counter() - t < 2.0  # O(1) each: ~0.1 s; a scan per call ~minutes
    assert len(runs) == n // 2 + n // 4


def test_pool_gives_a_long_request_one_run_despite_fragments():
    pool = BlockPool(16)
    a, b = [], []
    for _ in range(4):  # two requests growing a block at a time, interleaved
        a += pool.allocate(1, a[-1].block_id if a else None)
        b += pool.allocate(1, b[-1].block_id if b else None)
    assert ids(a) == [0, 2, 4, 6] and ids(b) == [1, 3, 5, 7]
    pool.free(list(reversed(a)))
    assert ids(pool.allocate(8)) == list(range(8, 16))  # not 0, 2, 4, 6, 8, ...
    assert pool.free_block_ids() == ([0, 2, 4, 6], [])


def test_pool_evicts_a_cached_prefix_only_when_nothing_else_is_free():
    pool = BlockPool(4)
    cached = pool.allocate(2)
    for b, n in zip(cached, (10, 11)):
        pool.cache(b, hash_block(None, [n]), block_preimage(None, [n]))
    pool.free(list(reversed(cached)))
    assert pool.free_block_ids() == ([2, 3], [1, 0])
    assert ids(pool.allocate(2)) == [2, 3]  # both prefixes survive
    assert pool.lookup(hash_block(None, [10])) is cached[0]
    assert ids(pool.allocate(1)) == [1]  # then the tail of the prefix goes first
    assert pool.lookup(hash_block(None, [11])) is None
    assert pool.lookup(hash_block(None, [10])) is cached[0]


def test_pool_evicted_blocks_come_back_as_a_run():
    # A finished request's cached blocks are freed tail first; evicted
    # together, they are handed out by id: one run again.
    pool = BlockPool(8)
    blocks = pool.allocate(6)
    for b in blocks:
        pool.cache(b, hash_block(None, [b.block_id]), block_preimage(None, [b.block_id]))
    pool.allocate(2)
    pool.free(list(reversed(blocks)))
    assert pool.free_block_ids() == ([], [5, 4, 3, 2, 1, 0])
    assert ids(pool.allocate(4)) == [2, 3, 4, 5]


def test_reset_prefix_cache_moves_free_cached_blocks_to_the_runs():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache(blocks[1], hash_block(None, [1]), block_preimage(None, [1]))
    pool.free(list(reversed(blocks)))
    assert pool.free_block_ids() == ([0, 2], [1])
    pool.reset_prefix_cache()
    assert pool.free_block_ids() == ([0, 1, 2], []) and pool.free_runs.runs() == [(0, 3)]


def test_a_growing_table_continues_its_run():
    kv = KVCacheManager(32, BS)
    other = Request("o", list(range(100, 104)), SamplingParams())
    a = Request("a", list(range(200, 206)), SamplingParams())
    assert kv.allocate_slots(a, 6)  # blocks 0, 1
    assert kv.allocate_slots(other, 4)  # block 2
    kv.free(other)  # one full block, cached: it waits in the LRU queue
    a.num_computed_tokens = 6
    for t in range(3):
        a.append_token(t)
    assert kv.allocate_slots(a, 3)
    assert kv.block_ids("a") == [0, 1, 3]  # 2 caches other's prefix: kept, and 3 is next
    kv2 = KVCacheManager(32, BS, enable_prefix_caching=False)
    c = Request("c", list(range(300, 304)), SamplingParams())
    d = Request("d", list(range(400, 404)), SamplingParams())
    kv2.allocate_slots(c, 4)  # block 0
    kv2.allocate_slots(d, 4)  # block 1
    kv2.free(d)
    c.num_computed_tokens = 4
    c.append_token(1)
    assert kv2.allocate_slots(c, 1)
    assert kv2.block_ids("c") == [0, 1]  # right after its last block
