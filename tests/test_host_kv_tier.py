"""The host KV tier on the CPU, where the "host pool" is a second pool in RAM:
prefix-cache blocks evicted from a small cache are kept there, and a later
hit is copied back instead of recomputed, giving the same tokens."""

from __future__ import annotations

import random

import pytest
from engine_fixtures import assert_all_free, tiny

from engine.config import CacheConfig
from engine.host_kv_tier import HostKVTier
from tandem import LLM, SamplingParams

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def prompt(seed: int, n: int = 28) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def test_tier_keeps_the_most_recent_blocks_and_checks_their_preimage():
    moved = []
    tier = HostKVTier(2, 100, lambda d, s: moved.append(("out", d, s)),
                      lambda s, d: moved.append(("in", s, d)))
    tier.save(7, b"a", b"pa")
    tier.save(8, b"b", b"pb")
    assert tier.contains(b"a", b"pa")  # a is now the most recently used
    tier.save(9, b"c", b"pc")  # full: b goes
    assert not tier.contains(b"b", b"pb") and tier.contains(b"c", b"pc")
    assert not tier.contains(b"a", b"other")  # same digest, other bytes: a miss
    tier.restore(b"a", 3)
    assert moved == [("out", 7, 0), ("out", 8, 1), ("out", 9, 1), ("in", 0, 3)]
    assert tier.bytes_moved == 400
    tier.clear()
    assert len(tier) == 0 and not tier.contains(b"c", b"pc")


def test_a_prefix_evicted_to_host_memory_is_served_from_there(tmp_path):
    model = str(tiny("llama-gqa")[0])
    first, other = prompt(1), prompt(2)
    # 8 blocks of 4 tokens: a 28-token prompt and its 4 new tokens fill them
    # all, so running `other` evicts all of `first`'s cached prefix.
    kw = dict(dtype="float32", block_size=BLOCK, num_blocks=8, max_num_batched_tokens=64)
    plain = LLM(model, **kw)
    want = plain.generate([first], GREEDY, use_tqdm=False)[0]
    llm = LLM(model, host_kv_cache_gib=0.01, **kw)
    engine = llm.engine
    assert llm.generate([first], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        want.outputs[0].token_ids
    llm.generate([other], GREEDY, use_tqdm=False)
    stats = engine.stats()
    assert stats.host_tier_restored_blocks == 0 and stats.host_tier_bytes > 0
    # Evictions copy KV out of the cache: reservations wait for the step.
    assert not engine.reserves_during_forward and plain.engine.reserves_during_forward
    again = llm.generate([first], GREEDY, use_tqdm=False)[0]
    # All of the prompt's full blocks but the last token's come back: nothing
    # of them is recomputed, and the tokens are the same.
    full = (len(first) - 1) // BLOCK
    assert again.num_cached_tokens == full * BLOCK
    assert engine.stats().host_tier_restored_blocks == full
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    assert_all_free(engine)
    # Without the tier the same sequence recomputes the prefix.
    plain.generate([other], GREEDY, use_tqdm=False)
    assert plain.generate([first], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        CacheConfig(host_kv_cache_gib=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="host_kv_cache_gib must be >= 0"):
        CacheConfig(host_kv_cache_gib=-1.0)
    with pytest.raises(ValueError, match="more than half of this machine"):
        LLM(str(tiny("llama-gqa")[0]), num_blocks=8, host_kv_cache_gib=1 << 20)
    with pytest.raises(ValueError, match="host_kv_cache_gib=1e-09 holds no KV block"):
        LLM(str(tiny("llama-gqa")[0]), num_blocks=8, host_kv_cache_gib=1e-9)


def test_a_preempted_request_resumes_from_the_host_tier_with_the_same_tokens():
    # 12 blocks of 4 tokens for two requests that grow to 8 blocks each: the
    # newest is preempted, its cached blocks are evicted by the other's
    # growth into host memory, and when it resumes they come back.
    model = str(tiny("llama-gqa")[0])
    prompts = [prompt(5, 16), prompt(6, 16)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    roomy = LLM(model, dtype="float32", block_size=BLOCK, num_blocks=64)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model, dtype="float32", block_size=BLOCK, num_blocks=12, host_kv_cache_gib=0.01)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.engine.stats().host_tier_restored_blocks > 0
    assert_all_free(llm.engine)


def test_a_tier_of_one_block_never_loses_the_block_it_restores():
    """Making room on the device for a restored block evicted another into
    the tier, which pushed out the one being restored (a single slot): a
    KeyError in the scheduler, and a device block never freed."""
    model = str(tiny("llama-gqa")[0])
    rng = random.Random(8)
    shared = prompt(81, 28)
    prompts = [shared[: rng.choice([8, 12, 20, 28])] + prompt(90 + i, rng.randrange(1, 8))
               for i in range(14)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(3, 20), ignore_eos=True)
              for _ in prompts]
    roomy = LLM(model, dtype="float32", block_size=4, num_blocks=256, max_model_len=64)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    one_block = roomy.engine.runner.block_bytes / 2**30
    llm = LLM(model, dtype="float32", block_size=4, num_blocks=18, max_model_len=64,
              host_kv_cache_gib=one_block)
    assert llm.engine.kv.host_tier.num_slots == 1
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert_all_free(llm.engine)
