"""The engine thread and a decode worker's calls into it.

``AsyncEngineLoop.run_concurrently``: a call that no forward pass reads (a
decode worker's reservation) is answered while the engine thread is inside
a forward pass, instead of after the step; behind queued ops, it keeps its
place. The thread never sleeps while queued requests can run, and a
reservation's open ``max_tokens`` is resolved as a request's."""

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


async def test_a_step_that_preempts_every_running_request_is_not_taken_for_idle():
    """Requests at the context's limit on a cache of one context: a step
    preempts all that ran and produces nothing. The engine thread took that
    for "nothing can run until an op comes" and slept with requests queued;
    their streams never ended."""
    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=8, block_size=4)  # 32 tokens in all
    aengine = AsyncEngineLoop(engine)

    async def one(i: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=22 - i, ignore_eos=True, n=1 + i % 2)
        outs = [out async for out in aengine.generate(list(range(3, 13 + i)), params, f"r{i}")]
        return [len(c.token_ids) for c in outs[-1].outputs]

    lengths = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), 60)
    assert lengths == [[22 - i] * (1 + i % 2) for i in range(6)]
    assert_all_free(engine)
    await aengine.shutdown()


def test_a_reservation_without_max_tokens_runs_to_the_end_of_the_context():
    """``max_tokens=None`` was resolved for the check alone: the first token
    then compared an int with None."""
    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=64, block_size=4, max_model_len=24)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    assert engine.reserve_remote("r", list(range(3, 13)), params)
    engine.start_remote("r", 5)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs[-1].outputs[0].token_ids) == 24 - 10
    assert outs[-1].outputs[0].finish_reason == "length"
    assert_all_free(engine)
