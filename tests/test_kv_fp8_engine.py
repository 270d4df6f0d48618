"""The engine with an fp8 KV cache: twice the blocks in the same bytes, the
same tokens from the torch and Triton backends and from two tensor-parallel
ranks as from one, and bad settings refused at start."""

from __future__ import annotations

import random

import pytest
from engine_fixtures import assert_all_free, tiny

from engine.config import CacheConfig, EngineConfig
from tandem import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny("llama-gqa")[0])


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 500) for _ in range(10)]
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 13)] + [
        shared + [7, 8], shared + [9]]


def run(model_dir: str, **kw) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=16,
              **kw)
    try:
        out = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert_all_free(llm.engine)
        return [list(o.outputs[0].token_ids) for o in out]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_fp8_cache_holds_twice_the_blocks_of_bf16_in_the_same_bytes(model_dir, kv):
    sizes = {}
    for cache in ("auto", kv):
        llm = LLM(model_dir, dtype="bfloat16", kv_cache_bytes=1 << 20, kv_cache_dtype=cache)
        sizes[cache] = llm.engine.stats().num_blocks
        k = llm.engine.runner.kv_caches[0][0]
        assert k.element_size() == (2 if cache == "auto" else 1)
        assert llm.engine.kv_cache_spec.name == ("bfloat16" if cache == "auto" else
                                                 {"fp8": "fp8_e4m3"}.get(kv, kv))
    assert sizes[kv] == 2 * sizes["auto"]


def test_fp8_torch_and_triton_backends_give_the_same_tokens(model_dir):
    assert run(model_dir, kv_cache_dtype="fp8", attention_backend="triton") == run(
        model_dir, kv_cache_dtype="fp8", attention_backend="torch")


def test_fp8_two_ranks_give_the_tokens_of_one(model_dir):
    assert run(model_dir, kv_cache_dtype="fp8", tensor_parallel_size=2) == run(
        model_dir, kv_cache_dtype="fp8")


def test_bad_settings_are_refused_at_start():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        CacheConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="only means something with an accelerator"):
        EngineConfig(model="m", cpu_offload_gb=1.0)
    with pytest.raises(ValueError, match="cpu_offload_gb must be >= 0"):
        EngineConfig(model="m", device="cuda", cpu_offload_gb=-1.0)
