"""A worker's engine loop and the cores it may borrow: a decode worker whose
blocks wait for a prefill worker's KV leaves the neighbours' cores alone,
since that prefill is likely computing on one of them right now."""

from __future__ import annotations

import torch
from engine_fixtures import assert_all_free, make_engine, tiny

from engine.async_engine import AsyncEngineLoop
from engine.core_lease import CoreLease
from engine.sampling_params import SamplingParams


async def test_no_borrowed_core_while_a_reservation_waits_for_its_kv(tmp_path):
    threads = torch.get_num_threads()
    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=64, block_size=4)
    cores = CoreLease([0], [0, 1], tmp_path)  # core 1 has no owner: free to borrow
    aengine = AsyncEngineLoop(engine, cores)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        await aengine.run(lambda e: e.reserve_remote("remote", [1, 2, 3, 4, 5], params))
        outs = [out async for out in aengine.generate([7, 8, 9], params, "local")]
        assert outs[-1].outputs[0].finish_reason == "length"
        assert cores.steps_borrowing == 0

        await aengine.abort("remote")  # no KV to wait for any more
        outs = [out async for out in aengine.generate([7, 8, 9], params, "local2")]
        assert outs[-1].outputs[0].finish_reason == "length"
        assert cores.steps_borrowing > 0
        assert_all_free(engine)
    finally:
        await aengine.shutdown()
        cores.close()
        torch.set_num_threads(threads)
