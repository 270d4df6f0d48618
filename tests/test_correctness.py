"""Greedy outputs equal Hugging Face ``generate`` token for token (float32),
whatever the engine does on the way: paging at several block sizes,
preemption, chunked prefill, prefix-cache hits, aborts. After every test
every block is free again."""

from __future__ import annotations

import functools

import pytest
from engine_fixtures import (
    assert_all_free,
    make_engine,
    random_prompts,
    record_steps,
    run_to_completion,
    tiny,
)
from tiny_models import VARIANTS, hf_greedy

from engine.sampling_params import SamplingParams

MAX_TOKENS = 16
# Mixed lengths: a one-token prompt, prompts inside one block, prompts over many.
PROMPTS = random_prompts((1, 5, 17, 40, 70), seed=1)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@functools.cache
def reference(variant: str, prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS) -> list[int]:
    return hf_greedy(tiny(variant)[1], list(prompt), max_tokens)


def generate(engine, prompts, params=GREEDY, prefix="r"):
    """Run ``prompts`` to completion; (outputs in order, how many times a
    request was preempted)."""
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    steps = record_steps(engine)
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    done = run_to_completion(engine)
    return [done[rid] for rid in ids], sum(len(sched.preempted) for sched in steps)


def check_equal_hf(variant, prompts, outputs, max_tokens=MAX_TOKENS):
    for prompt, out in zip(prompts, outputs):
        (comp,) = out.outputs
        assert comp.token_ids == reference(variant, tuple(prompt), max_tokens), (
            f"{variant}: prompt of {len(prompt)} tokens"
        )
        assert comp.finish_reason == "length"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_equals_hf(variant):
    engine = make_engine(tiny(variant)[0], block_size=16)
    outputs, _ = generate(engine, PROMPTS)
    check_equal_hf(variant, PROMPTS, outputs)
    assert_all_free(engine)


@pytest.mark.parametrize("block_size", [1, 32])
def test_block_sizes(block_size):
    engine = make_engine(tiny("llama-gqa")[0], block_size=block_size, num_blocks=1024)
    outputs, preemptions = generate(engine, PROMPTS)
    check_equal_hf("llama-gqa", PROMPTS, outputs)
    assert preemptions == 0
    assert_all_free(engine)


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
def test_preemption_recomputes_to_the_same_tokens(caching):
    # 70 + 16 tokens need 6 blocks of 16; 8 blocks hold one long request at a time.
    engine = make_engine(tiny("llama-gqa")[0], block_size=16, num_blocks=8,
                         enable_prefix_caching=caching)
    outputs, preemptions = generate(engine, PROMPTS)
    check_equal_hf("llama-gqa", PROMPTS, outputs)
    assert preemptions > 0
    assert_all_free(engine)


def test_chunked_prefill():
    engine = make_engine(tiny("qwen2")[0], block_size=16, max_num_batched_tokens=8)
    steps = record_steps(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    done = run_to_completion(engine)
    assert all(sched.num_batched_tokens <= 8 for sched in steps)
    chunks = sum(1 for sched in steps for s in sched.scheduled
                 if s.num_new_tokens > 1 and not s.sample)
    assert chunks >= 10  # prompts really were split
    check_equal_hf("qwen2", PROMPTS, [done[f"r{i}"] for i in range(len(PROMPTS))])
    assert_all_free(engine)


def test_chunked_prefill_with_preemption_and_block_size_1():
    engine = make_engine(tiny("mistral")[0], block_size=1, num_blocks=100,
                         max_num_batched_tokens=16)
    outputs, preemptions = generate(engine, PROMPTS)
    check_equal_hf("mistral", PROMPTS, outputs)
    assert preemptions > 0
    assert_all_free(engine)


def test_prefix_cache_hits_give_the_same_tokens():
    variant = "llama-mqa-tied"
    engine = make_engine(tiny(variant)[0], block_size=16)
    prefix = random_prompts((40,), seed=7)[0]
    first = [prefix + [5, 6, 7]]
    # The same prompt twice in one batch (the second hits blocks the first
    # writes in that same step), and a sibling with another tail.
    second = [prefix + [5, 6, 7], prefix + [5, 6, 7], prefix + [9, 9]]
    out1, _ = generate(engine, first, prefix="a")
    assert out1[0].num_cached_tokens == 0
    out2, _ = generate(engine, second, prefix="b")
    assert [o.num_cached_tokens for o in out2] == [32, 32, 32]
    check_equal_hf(variant, first + second, out1 + out2)
    assert engine.stats().prefix_hits >= 96
    assert_all_free(engine)


def test_identical_prompts_in_one_step_share_blocks():
    engine = make_engine(tiny("llama-gqa")[0], block_size=4)
    prompt = PROMPTS[3]  # 40 tokens
    steps = record_steps(engine)
    for rid in ("x", "y"):
        engine.add_request(rid, prompt, GREEDY)
    outs = {o.request_id: o for o in engine.step()}
    (sched,) = steps
    x, y = sched.new_requests
    assert sched.scheduled[1].start == 36 and outs["y"].num_cached_tokens == 36
    assert y.block_ids[:9] == x.block_ids[:9]
    assert outs["x"].outputs[0].token_ids == outs["y"].outputs[0].token_ids
    engine.abort_request(["x", "y"])
    assert_all_free(engine)


def test_aborts_free_everything_and_leave_the_rest_correct():
    engine = make_engine(tiny("llama-gqa")[0], block_size=16, max_num_batched_tokens=32)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"keep{i}", prompt, GREEDY)
        engine.add_request(f"drop{i}", prompt[::-1] + [3], GREEDY)
    outs = engine.step() + engine.step()
    assert all(not o.finished for o in outs)
    aborted = engine.abort_request([f"drop{i}" for i in range(len(PROMPTS))] + ["unknown"])
    assert [a.request_id for a in aborted] == [f"drop{i}" for i in range(len(PROMPTS))]
    assert all(a.finished and a.outputs[0].finish_reason == "abort" for a in aborted)
    assert engine.abort_request("drop0") == []  # twice: nothing left to abort
    done = run_to_completion(engine)
    assert sorted(done) == sorted(f"keep{i}" for i in range(len(PROMPTS)))
    check_equal_hf("llama-gqa", PROMPTS, [done[f"keep{i}"] for i in range(len(PROMPTS))])
    assert_all_free(engine)
