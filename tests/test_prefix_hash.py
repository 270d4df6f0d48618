"""Prefix-cache digests (engine/prefix_hash.py): chained, the same in every
process, cheap; and a cache hit needs the block's content to match, so two
blocks forced to one key never share KV."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from engine_fixtures import make_engine, random_prompts, run_to_completion, tiny

from engine import prefix_hash
from engine.kv_cache_manager import KVCacheManager
from engine.prefix_hash import block_preimage, hash_block, hash_blocks, pack_tokens
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def test_digest_is_chained_and_covers_the_whole_prefix():
    h0 = hash_block(None, [1, 2, 3, 4])
    assert isinstance(h0, bytes) and len(h0) == prefix_hash.DIGEST_SIZE
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(hash_block(None, [1, 2, 3, 5]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) == h0
    tokens = list(range(100, 110))
    chained = [hash_block(None, tokens[:4])]
    chained.append(hash_block(chained[0], tokens[4:8]))
    assert hash_blocks(None, tokens, 4) == chained  # the partial last block has no digest
    assert hash_blocks(chained[0], tokens[4:], 4) == chained[1:]


def test_tokens_are_packed_as_little_endian_int64():
    assert pack_tokens([1, 256]) == (1).to_bytes(8, "little") + (256).to_bytes(8, "little")
    assert block_preimage(None, [7]) == bytes(prefix_hash.DIGEST_SIZE) + pack_tokens([7])
    # Ids that a narrower packing would fold together stay apart.
    assert hash_block(None, [1 << 32]) != hash_block(None, [0])


def test_digest_is_the_same_in_every_process():
    code = ("from engine.prefix_hash import hash_block; "
            "print(hash_block(hash_block(None, [1, 2, 3]), [4, 5, 6]).hex())")
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    assert outs == {hash_block(hash_block(None, [1, 2, 3]), [4, 5, 6]).hex()}


def test_hashing_a_long_prompt_is_cheap():
    tokens = random_prompts((4096,), seed=3)[0]
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        hash_blocks(None, tokens, 16)
        best = min(best, time.perf_counter() - start)
    print(f"4096 tokens in blocks of 16: {best * 1e6:.0f} us")
    assert best < 0.02  # a few hundred microseconds expected; generous for loaded machines


# ---- collisions ------------------------------------------------------------------------


@pytest.fixture
def constant_digest(monkeypatch):
    """Every block of every prompt gets one and the same digest (one key)."""
    monkeypatch.setattr(prefix_hash, "digest", lambda preimage: b"\x01" * prefix_hash.DIGEST_SIZE)


def test_a_colliding_key_is_a_miss(constant_digest):
    kv = KVCacheManager(8, BS)
    a = req("a", [10, 11, 12, 13, 14])
    assert kv.allocate_slots(a, 5)
    assert kv.pool.blocks[0].block_hash is not None  # published under the constant key
    b = req("b", [20, 21, 22, 23, 24])
    assert b.block_hashes == [] and kv.get_computed_blocks(b) == ([], 0)
    assert b.block_hashes == a.block_hashes  # the same key, and yet no hit
    # A longer prompt that shares a's first block: that block is a hit, the
    # next one (same key again, other content) is not.
    c = req("c", [10, 11, 12, 13, 30, 31, 32, 33, 34])
    hits, n = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0] and n == BS


def test_a_truncated_digest_that_collides_is_a_miss(monkeypatch):
    real = prefix_hash.digest
    monkeypatch.setattr(prefix_hash, "digest", lambda preimage: real(preimage)[:1])
    target = hash_block(None, [1, 2, 3, 4])
    other = next([1, 2, 3, t] for t in range(5, 100_000)
                 if hash_block(None, [1, 2, 3, t]) == target)
    kv = KVCacheManager(8, BS)
    kv.allocate_slots(req("a", [1, 2, 3, 4, 9]), 5)
    assert kv.get_computed_blocks(req("b", other + [9])) == ([], 0)
    hits, n = kv.get_computed_blocks(req("c", [1, 2, 3, 4, 9]))
    assert [h.block_id for h in hits] == [0] and n == BS


def test_same_prompts_still_hit():
    kv = KVCacheManager(8, BS)
    tokens = list(range(100, 113))
    kv.allocate_slots(req("a", tokens), 13)
    hits, n = kv.get_computed_blocks(req("b", tokens))
    assert [h.block_id for h in hits] == [0, 1, 2] and n == 12


def test_colliding_prompts_in_an_engine_compute_their_own_kv(monkeypatch):
    model = tiny("llama-gqa")[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first, second = random_prompts((40, 40), seed=11)

    def run(engine, prompts, prefix):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{prefix}{i}", prompt, params)
        done = run_to_completion(engine)
        return [done[f"{prefix}{i}"] for i in range(len(prompts))]

    expected = run(make_engine(model, block_size=16, enable_prefix_caching=False),
                   [first, second], "x")
    monkeypatch.setattr(prefix_hash, "digest",
                        lambda preimage: b"\x01" * prefix_hash.DIGEST_SIZE)
    engine = make_engine(model, block_size=16)
    (out1,) = run(engine, [first], "a")
    (out2,) = run(engine, [second], "b")  # every block of it collides with first's
    assert out2.num_cached_tokens == 0
    assert [o.outputs[0].token_ids for o in (out1, out2)] == [
        o.outputs[0].token_ids for o in expected]
    (again,) = run(engine, [first], "c")  # the same prompt still hits (its first block)
    assert again.num_cached_tokens == 16
    assert again.outputs[0].token_ids == expected[0].outputs[0].token_ids
