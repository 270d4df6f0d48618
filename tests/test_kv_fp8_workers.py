"""An fp8 KV cache across real workers: the handoff moves one byte per value,
a worker with another cache dtype is refused at the handshake, and the tokens
are those of the same engine in one process.

Three worker processes on loopback (bfloat16 models, like a GPU deployment):
a prefill and a decode worker with ``--kv-cache-dtype fp8``, and a decode
worker with the default cache.
"""

from __future__ import annotations

import grpc
import pytest
from engine_fixtures import tiny
from worker_fixtures import Gateway, metric, params, rpc_error, scrape, start_worker

from kv_transfer.layout import KVLayout
from tandem.cluster import LocalCluster

NUM_BLOCKS = 32
FP8 = ("--dtype", "bfloat16", "--kv-cache-dtype", "fp8")
PROMPT = [1, *range(40, 110)]  # 71 tokens: 5 blocks of 16


@pytest.fixture(scope="module")
def model_dir():
    return tiny("llama-gqa")[0]


@pytest.fixture(scope="module")
def workers(model_dir):
    with LocalCluster() as cluster:
        prefill = start_worker(cluster, "prefill", model_dir, NUM_BLOCKS, *FP8, metrics=True)
        decode = start_worker(cluster, "decode", model_dir, NUM_BLOCKS, *FP8)
        plain = start_worker(cluster, "decode", model_dir, NUM_BLOCKS, "--dtype", "bfloat16")
        yield prefill, decode, plain


@pytest.fixture
async def gw():
    async with Gateway() as g:
        yield g


def sent_bytes(port: int, transport: str) -> float:
    return metric(scrape(port), "tandem:kv_transfer_bytes_total", transport=transport,
                  direction="send") or 0.0


@pytest.mark.parametrize("transport", ["grpc", "torch"])
async def test_fp8_handoff_moves_one_byte_per_value_and_keeps_the_tokens(
        workers, gw, model_dir, transport):
    from tandem import LLM

    prefill, decode, _ = workers
    sp = params(temperature=0, max_tokens=8)
    # The first transfer to a peer also measures it (preflight bytes): warm up.
    await gw.disaggregated(prefill, decode, f"warm-{transport}", PROMPT[:20], sp, transport)
    before = sent_bytes(prefill.metrics_port, transport)
    got = await gw.disaggregated(prefill, decode, f"fp8-{transport}", PROMPT, sp, transport)
    moved = sent_bytes(prefill.metrics_port, transport) - before

    layout = KVLayout.from_proto((await gw.info(decode)).layout)
    assert layout.kv_cache_dtype == "fp8_e4m3" and layout.dtype == "bfloat16"
    assert layout.kv_scales == (1.0, 1.0)
    blocks = -(-len(PROMPT) // layout.block_size)
    per_value = moved / (blocks * layout.num_layers * 2 * layout.block_size
                         * layout.num_kv_heads * layout.head_dim)
    assert per_value == 1.0, f"{moved} bytes for {blocks} blocks: {per_value} bytes per value"

    offline = LLM(str(model_dir), dtype="bfloat16", kv_cache_dtype="fp8", num_blocks=64)
    from engine.sampling_params import SamplingParams

    ref = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert got.token_ids == list(ref[0].outputs[0].token_ids)
    await gw.wait_idle([prefill, decode])


async def test_a_decode_worker_with_another_cache_dtype_is_refused(workers, gw):
    prefill, _, plain = workers
    sp = params(temperature=0, max_tokens=2)
    ticket = await gw.reserve(plain, "mixed", PROMPT, sp)
    err = await rpc_error(gw.prefill(prefill, "mixed", PROMPT, sp, ticket, "grpc"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "kv_cache_dtype: this worker 'fp8_e4m3'" in err.details()
    assert "'bfloat16'" in err.details()
    assert await gw.abort(plain, "mixed")
    await gw.wait_idle(list(workers))
