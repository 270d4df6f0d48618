"""Tensor parallelism on the CPU: two real processes joined by gloo, each
holding half the heads and MLP columns, give the tokens of one process."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from engine_fixtures import assert_all_free
from tiny_models import AWQ, GPTQ, build_tiny_model, quantize_checkpoint
from worker_fixtures import Gateway, params, rpc_error, start_worker

from tandem import LLM, AsyncEngine, SamplingParams
from tandem.cluster import LocalCluster


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {name: str(build_tiny_model(name, root)[0]) for name in ("llama-gqa", "qwen2")}


def _prompts():
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(12)]
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (2, 9, 31)] + [
        shared + [5], shared + [6, 7]]


def _run(model: str, tp: int, params) -> list[list[int]]:
    # Small token budget: prompts are chunked; the shared prefix hits the cache.
    llm = LLM(model, dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=16,
              tensor_parallel_size=tp)
    try:
        first = llm.generate(_prompts(), params, use_tqdm=False)
        again = llm.generate(_prompts(), params, use_tqdm=False)
        assert any(o.num_cached_tokens for o in again)
        assert_all_free(llm.engine)
        return [o.outputs[0].token_ids for o in first]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_two_ranks_give_the_tokens_of_one(models, name):
    greedy = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    assert _run(models[name], 2, greedy) == _run(models[name], 1, greedy)


def test_vocabulary_is_split_and_prompt_logprobs_match(models):
    """Each rank holds half the embedding table and LM head; the logits
    rank 0 gathers give the same prompt logprobs as one rank's."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2,
                            logprobs=2)
    outs = {}
    for tp in (1, 2):
        llm = LLM(models["llama-gqa"], dtype="float32", num_blocks=32, block_size=4, max_num_batched_tokens=8,
                  tensor_parallel_size=tp)
        try:
            model = llm.engine.runner.model
            assert model.embed_tokens.weight.shape[0] == 512 // tp
            assert model.lm_head.weight.shape[0] == 512 // tp
            outs[tp] = llm.generate(_prompts()[:3], params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
    for one, two in zip(outs[1], outs[2]):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        assert len(one.prompt_logprobs) == len(one.prompt_token_ids)
        assert len(two.prompt_logprobs) == len(two.prompt_token_ids)
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_seeded_sampling_is_the_same_on_two_ranks(models):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=6, ignore_eos=True)
    assert _run(models["llama-gqa"], 2, seeded) == _run(models["llama-gqa"], 1, seeded)


def test_shutdown_stops_the_follower_ranks(models):
    llm = LLM(models["llama-gqa"], dtype="float32", num_blocks=16, tensor_parallel_size=2)
    procs = list(llm.engine.runner.followers.procs)
    assert [p.name for p in procs] == ["tandem-tp1"] and procs[0].is_alive()
    llm.engine.shutdown()
    llm.engine.shutdown()  # idempotent
    assert not procs[0].is_alive() and procs[0].exitcode == 0


def test_an_llm_dropped_without_shutdown_lets_the_next_one_form_its_group(models):
    """``del llm`` left rank 0 in its process group: the next LLM with
    tensor parallelism in the process failed ("initialize the default
    process group twice")."""
    import gc

    llm = LLM(models["llama-gqa"], dtype="float32", num_blocks=16, tensor_parallel_size=2)
    (proc,) = llm.engine.runner.followers.procs
    del llm
    gc.collect()
    proc.join(30)
    assert not proc.is_alive()
    again = LLM(models["llama-gqa"], dtype="float32", num_blocks=16, tensor_parallel_size=2)
    assert again.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    again.engine.shutdown()


def test_async_engine_shutdown_stops_the_followers(models):
    async def main():
        engine = AsyncEngine(models["llama-gqa"], num_blocks=16, tensor_parallel_size=2)
        procs = list(engine.engine.runner.followers.procs)
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        outs = [o async for o in engine.generate([5, 6, 7], params, "r1")]
        assert len(outs[-1].outputs[0].token_ids) == 3
        await engine.shutdown()
        return procs

    procs = asyncio.run(main())
    assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(tensor_parallel_size=3), "must divide num_attention_heads"),
    (dict(tensor_parallel_size=4), "must divide num_key_value_heads"),  # 2 kv heads
    (dict(tensor_parallel_size=0), "at least 1"),
])
def test_unsplittable_sizes_are_refused(models, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(models["llama-gqa"], num_blocks=16, **kwargs)


def test_a_vocabulary_the_ranks_cannot_share_is_refused(tmp_path):
    model, _ = build_tiny_model("llama-gqa", tmp_path, vocab_size=511)
    with pytest.raises(ValueError, match=r"must divide vocab_size \(511\)"):
        LLM(str(model), num_blocks=16, tensor_parallel_size=2)


# ---- workers: KV moves as whole-model blocks, whatever either side's split ----


@pytest.fixture(scope="module")
def tp_workers(models):
    model = models["llama-gqa"]
    with LocalCluster() as cluster:
        prefill = start_worker(cluster, "prefill", model, 64, "-tp", "2",
                               "--max-num-batched-tokens", "16")
        decode_tp2 = start_worker(cluster, "decode", model, 64, "-tp", "2")
        decode_tp1 = start_worker(cluster, "decode", model, 64)
        yield prefill, [decode_tp2, decode_tp1]


@pytest.mark.parametrize("transport", ["grpc", "torch"])
async def test_disaggregated_across_split_workers_matches_offline(models, tp_workers, transport):
    prefill, decodes = tp_workers
    prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=6)
    async with Gateway() as gw:
        got = await asyncio.gather(*(
            gw.disaggregated(prefill, decodes[i % 2], f"{transport}-{i}", prompt,
                             params(**vars(sp)), transport)
            for i, prompt in enumerate(prompts)
        ))
        await gw.wait_idle([prefill, *decodes])
    expected = _run(models["llama-gqa"], 1, sp)
    assert [c.token_ids for c in got] == expected


@pytest.mark.parametrize("name,cfg,act_order", [
    ("gptq-act-order", {**GPTQ, "desc_act": True, "group_size": 16}, True),
    ("awq", AWQ, False),
])
def test_quantized_checkpoints_split_over_two_ranks(models, tmp_path, name, cfg, act_order):
    """Column-parallel layers split the packed columns; row-parallel ones
    split the packed rows and g_idx and keep every group's scales."""
    qdir, _ = quantize_checkpoint(Path(models["llama-gqa"]), tmp_path / name, cfg, act_order)
    greedy = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    assert _run(str(qdir), 2, greedy) == _run(str(qdir), 1, greedy)


def test_cpu_ranks_share_the_cores_and_give_them_back(models):
    import os

    import torch

    before = torch.get_num_threads()
    llm = LLM(models["llama-gqa"], dtype="float32", num_blocks=16, tensor_parallel_size=2)
    assert torch.get_num_threads() == max(1, os.cpu_count() // 2)
    llm.engine.shutdown()
    assert torch.get_num_threads() == before


def test_a_dead_follower_is_named_at_the_next_step(models):
    import os
    import signal

    llm = LLM(models["llama-gqa"], dtype="float32", num_blocks=16, tensor_parallel_size=2)
    (proc,) = llm.engine.runner.followers.procs
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(RuntimeError, match="tandem-tp1 is gone"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    llm.engine.shutdown()  # does not hang on the dead rank


async def test_a_worker_that_loses_a_rank_drains_and_exits(models):
    """The engine cannot step without its follower: the worker fails what
    ran, stops taking work and exits non-zero, for its supervisor to restart."""
    import os
    import signal
    import subprocess

    with LocalCluster() as cluster:
        worker = start_worker(cluster, "both", models["llama-gqa"], 32, "-tp", "2")
        # The follower rank: the worker's child started by multiprocessing's spawn.
        children = subprocess.run(["pgrep", "-P", str(worker.proc.popen.pid)],
                                  capture_output=True, text=True).stdout.split()
        followers = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(followers) == 1, children
        os.kill(int(followers[0]), signal.SIGKILL)
        async with Gateway() as gw:
            err = await rpc_error(gw.colocated(worker, "r-lost", [5, 6, 7],
                                               params(temperature=0, max_tokens=4)))
        # Named at the next command, or the collective it was in failed.
        assert "tandem-tp1 is gone" in err.details() or \
            "tensor-parallel group failed" in err.details()
        assert worker.proc.popen.wait(30) == 1



def test_a_failed_command_breaks_the_group_for_good(models):
    """Rank 0 fails in the middle of a step while its follower lives on (say,
    out of memory): the ranks are out of step, so nothing is sent again,
    watchers hear of it once, and shutdown does not wait on the follower."""
    import time

    from engine.errors import EngineUnusable

    llm = LLM(models["llama-gqa"], dtype="float32", num_blocks=16, tensor_parallel_size=2)
    runner = llm.engine.runner
    (proc,) = runner.followers.procs
    heard = []
    llm.engine.on_unusable(lambda: heard.append(True))
    real_forward = runner.shard.forward

    def failing_forward(batch, logit_calls=()):
        raise RuntimeError("out of memory (simulated)")

    runner.shard.forward = failing_forward
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(EngineUnusable, match="simulated"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    runner.shard.forward = real_forward
    start = time.monotonic()
    with pytest.raises(EngineUnusable, match="failed earlier"):
        llm.generate([[8, 9]], params, use_tqdm=False)
    with pytest.raises(EngineUnusable, match="failed earlier"):
        runner.kv_blocks.read([0])
    assert time.monotonic() - start < 5 and heard == [True]
    assert proc.is_alive()  # waiting in an all-reduce rank 0 will never join
    llm.engine.shutdown()
    assert time.monotonic() - start < 15 and not proc.is_alive()
