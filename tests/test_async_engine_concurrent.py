"""``AsyncEngineLoop.run_concurrently``: a call that no forward pass reads
(a decode worker's reservation) is answered while the engine thread is
inside a forward pass, instead of after the step; behind queued ops, it
keeps its place."""

from __future__ import annotations

import asyncio
import threading

from engine_fixtures import assert_all_free, make_engine, tiny

from engine.async_engine import AsyncEngineLoop
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _gated(engine):
    """Make the engine's forward passes wait at a gate while ``hold`` is set:
    ``entered`` says one is waiting there."""
    hold, entered, gate = threading.Event(), threading.Event(), threading.Event()
    real = engine.runner.execute

    def execute(sched):
        if hold.is_set() and sched.scheduled:
            entered.set()
            assert gate.wait(60), "the test never opened the gate"
        return real(sched)

    engine.runner.execute = execute
    return hold, entered, gate


async def _wait(event: threading.Event) -> None:
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, 60)


async def test_a_reservation_is_answered_during_a_forward_pass():
    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=64, block_size=4)
    aengine = AsyncEngineLoop(engine)
    hold, entered, gate = _gated(engine)
    try:
        hold.set()
        running = asyncio.ensure_future(
            _collect(aengine.generate([7, 8, 9], PARAMS, "running")))
        await _wait(entered)  # the engine thread is inside the forward pass
        block_ids = await asyncio.wait_for(aengine.run_concurrently(
            lambda e: e.reserve_remote("remote", [1, 2, 3, 4, 5], PARAMS)), 10)
        assert len(block_ids) == 2 and not running.done()
        gate.set()
        outs = await asyncio.wait_for(running, 60)
        assert outs[-1].outputs[0].finish_reason == "length"
        # The running request never wrote into the reserved blocks.
        assert engine.kv.block_ids("remote") == block_ids
        await aengine.abort("remote")
        assert_all_free(engine)
    finally:
        gate.set()
        await aengine.shutdown()


async def test_a_concurrent_call_waits_behind_queued_ops():
    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=64, block_size=4)
    aengine = AsyncEngineLoop(engine)
    hold, entered, gate = _gated(engine)
    order: list[str] = []
    try:
        hold.set()
        running = asyncio.ensure_future(
            _collect(aengine.generate([7, 8, 9], PARAMS, "running")))
        await _wait(entered)
        queued = asyncio.ensure_future(aengine.run(lambda e: order.append("queued")))
        await asyncio.sleep(0)
        concurrent = asyncio.ensure_future(
            aengine.run_concurrently(lambda e: order.append("concurrent")))
        await asyncio.sleep(0.2)
        assert order == [] and not concurrent.done()  # it did not overtake the op
        hold.clear()
        gate.set()
        await asyncio.wait_for(asyncio.gather(queued, concurrent, running), 60)
        assert order == ["queued", "concurrent"]
        assert_all_free(engine)
    finally:
        gate.set()
        await aengine.shutdown()


async def _collect(outputs):
    return [out async for out in outputs]
