"""A request id used again as soon as its request has ended (a retry on the
same worker) gets only its own outputs, never the old request's last ones,
which may still be on their way from the engine thread."""

from __future__ import annotations

import asyncio
import contextlib

from engine_fixtures import assert_all_free, make_engine, tiny

from engine.async_engine import AsyncEngineLoop
from engine.sampling_params import SamplingParams


async def test_an_id_used_again_at_once_gets_only_its_own_outputs():
    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=64, block_size=4)
    aengine = AsyncEngineLoop(engine)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fresh = [out async for out in aengine.generate([7, 8, 9], short, "fresh")]
    want = fresh[-1].outputs[0].token_ids
    for attempt in range(5):
        # Cancelled after two outputs, while the engine keeps stepping it; the
        # new request starts while the old one's abort is still under way.
        started = asyncio.Event()

        async def old(started: asyncio.Event) -> None:
            async with contextlib.aclosing(aengine.generate([1, 2, 3], long, "same")) as outs:
                async for n, _ in aiter_enumerate(outs):
                    if n == 1:
                        started.set()

        task = asyncio.ensure_future(old(started))
        await started.wait()
        task.cancel()
        await asyncio.sleep(0)  # the old stream is gone; its abort is on its way
        outs = [out async for out in aengine.generate([7, 8, 9], short, "same")]
        got = [t for out in outs for t in out.outputs[0].delta_token_ids]
        assert got == want, f"attempt {attempt}: {got} != {want}"
        assert outs[-1].outputs[0].finish_reason == "length"
    assert_all_free(engine)
    await aengine.shutdown()


async def aiter_enumerate(items):
    n = 0
    async for item in items:
        yield n, item
        n += 1
