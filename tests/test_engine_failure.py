"""A model failure in one step fails the requests it touched, answers every
caller, forgets the prefix cache it may have poisoned, and the engine keeps
serving."""

from __future__ import annotations

import asyncio

import pytest
from engine_fixtures import assert_all_free, make_engine, tiny

from engine.async_engine import AsyncEngineLoop
from engine.sampling_params import SamplingParams


@pytest.fixture
def engine():
    model_dir, _ = tiny("llama-gqa")
    return make_engine(model_dir, num_blocks=64, block_size=4)


async def test_a_failed_step_fails_its_requests_and_the_engine_recovers(engine):
    aengine = AsyncEngineLoop(engine)
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def failing_once(out):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real_execute(out)

    engine.runner.execute = failing_once
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(3, 23))  # five full blocks: published to the prefix cache

    async def drain():
        return [out async for out in aengine.generate(prompt, params, "first")]

    # The add and the failing step land in the same tick: the caller must get
    # an error, not wait forever.
    with pytest.raises(RuntimeError, match="engine step failed"):
        await asyncio.wait_for(drain(), timeout=30)
    assert_all_free(engine)

    outs = [out async for out in aengine.generate(prompt, params, "second")]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    # The failed step had published the prompt's blocks; they were forgotten,
    # so nothing was served from blocks it never wrote.
    assert outs[-1].num_cached_tokens == 0
    await aengine.abort("second")
    assert_all_free(engine)
    await aengine.shutdown()
