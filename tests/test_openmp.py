"""One OpenMP team per process: the engine is built and stepped on one
thread, and other threads that touch tensors never start a team."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from engine_fixtures import make_engine, tiny

from engine.async_engine import AsyncEngineLoop
from engine.openmp import serial_thread
from engine.sampling_params import SamplingParams


def _os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _threads_a_parallel_op_adds(prepare) -> tuple[int, int]:
    """OS threads born while a fresh thread runs a parallel op (new thread
    ids: threads of earlier tests that exit meanwhile do not count)."""
    seen = {}

    def body():
        prepare()
        before = _os_threads()
        x = torch.randn(1024, 1024)
        (x * 2).sum()  # large enough for torch to split it across its team
        seen["added"] = len(_os_threads() - before)
        seen["team"] = torch.get_num_threads()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return seen["added"], seen["team"]


@pytest.mark.skipif(torch.get_num_threads() < 2 or not os.path.isdir("/proc/self/task"),
                    reason="needs a team of two or more threads, and Linux's /proc")
def test_a_serial_thread_starts_no_team_of_its_own():
    main_team = torch.get_num_threads()
    added, team = _threads_a_parallel_op_adds(lambda: None)
    assert team == main_team and added == main_team - 1  # the control: a thread's own team
    added, team = _threads_a_parallel_op_adds(serial_thread)
    assert team == 1 and added == 0
    assert torch.get_num_threads() == main_team  # the other threads keep theirs


async def test_the_engine_is_built_and_stepped_on_the_same_thread():
    model_dir, _ = tiny("llama-gqa")
    built_on = {}

    def build():
        built_on["thread"] = threading.current_thread()
        return make_engine(model_dir, num_blocks=64, block_size=4)

    aengine = AsyncEngineLoop(build)
    try:
        assert built_on["thread"] is not threading.current_thread()
        assert built_on["thread"].name == "engine"
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        outs = [o async for o in aengine.generate(list(range(3, 12)), params, "r")]
        assert len(outs[-1].outputs[0].token_ids) == 3
        stepped_on = await aengine.run(lambda engine: threading.current_thread())
        assert stepped_on is built_on["thread"]
    finally:
        await aengine.shutdown()


def test_a_build_that_fails_raises_from_the_constructor():
    def build():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngineLoop(build)
