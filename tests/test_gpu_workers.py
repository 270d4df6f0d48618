"""Disaggregated workers with their KV caches on CUDA: a prefill worker hands
each request's blocks to a decode worker, and the tokens are the offline
engine's. gRPC bytes on one GPU; the ``torch`` transport over NCCL, which
needs one GPU per worker (NCCL refuses two ranks on one device), on two:
there it sends layer by layer (``--kv-layer-writes auto`` on a GPU), the
five requests' payloads interleaved on the pair's frame channel.
Skipped (not faked) without them. Part of ``benchmarks/gpu_checks.sh``.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from engine_fixtures import random_prompts, tiny
from worker_fixtures import Gateway, params, start_worker

from engine.sampling_params import SamplingParams
from tandem.cluster import LocalCluster

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="set TRITON_INTERPRET=0 to compile the kernels for the GPU"),
]

NUM_BLOCKS = 64
PROMPT_LENGTHS = [3, 17, 40, 100, 33]
MAX_TOKENS = [8, 1, 12, 6, 9]


def gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs")


@pytest.mark.parametrize("transport,decode_device", [
    pytest.param("grpc", "cuda:0", id="grpc-one-gpu"),
    pytest.param("torch", "cuda:1", id="nccl-two-gpus", marks=gpus(2)),
])
def test_disaggregated_on_gpu_matches_offline(transport, decode_device):
    from tandem import LLM

    model_dir = tiny("llama-gqa")[0]
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    sps = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    offline = LLM(str(model_dir), device="cuda", dtype="float32", num_blocks=256)
    expected = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                for o in offline.generate(prompts, sps, use_tqdm=False)]
    offline.engine.shutdown()

    with LocalCluster() as cluster:
        prefill = start_worker(cluster, "prefill", model_dir, NUM_BLOCKS,
                               "--device", "cuda:0", "--transport", transport)
        decode = start_worker(cluster, "decode", model_dir, NUM_BLOCKS,
                              "--device", decode_device, "--transport", transport)

        async def run():
            async with Gateway() as gw:
                got = await asyncio.gather(*(
                    gw.disaggregated(prefill, decode, f"gpu-{transport}-{i}", prompt,
                                     params(**vars(sp)), transport)
                    for i, (prompt, sp) in enumerate(zip(prompts, sps))))
                await gw.wait_idle([prefill, decode])  # every block back on both sides
                return got

        got = asyncio.run(run())
    assert [(c.token_ids, c.finish_reason) for c in got] == expected
