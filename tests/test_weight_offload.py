"""``cpu_offload_gb``'s mechanism (engine/weight_offload.py) on the CPU: the
option itself is refused there (tests/test_kv_fp8_engine.py), so the offload is
applied to a CPU engine's layers directly, with nothing pinned. The real thing,
pinned host memory streamed to a GPU, is tests/test_gpu.py's."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import tiny

from engine.weight_offload import GB, WeightOffload, param_bytes
from tandem import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9, 30, 41], list(range(3, 40))]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(tiny("llama-gqa")[0]), dtype="float32", num_blocks=32, block_size=4)


def test_an_offload_larger_than_the_layers_is_refused(llm):
    layers = list(llm.engine.runner.model.layers)
    total = sum(param_bytes(layer) for layer in layers)
    with pytest.raises(ValueError, match="hold only .* bytes of weights; lower cpu_offload_gb"):
        WeightOffload(layers, (total + 1) / GB, torch.device("cpu"), pin=False)


def test_offloaded_layers_give_the_same_tokens_and_are_host_tensors_between_forwards(llm):
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    layers = list(llm.engine.runner.model.layers)
    first = param_bytes(layers[0])
    offload = WeightOffload(layers, (first + 1) / GB, torch.device("cpu"), pin=False)
    assert offload.num_layers == 2 and offload.bytes_offloaded == 2 * first  # whole layers
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    for i in range(offload.num_layers):
        for p, host in offload.host[i]:
            assert p.data.data_ptr() == host.data_ptr()
    assert not offload._prefetched  # nothing left half-fetched

