"""The whole engine with the Triton attention backend (run by Triton's CPU
interpreter here) gives the same greedy tokens as the torch backend."""

from __future__ import annotations

import random

import pytest
from engine_fixtures import assert_all_free
from tiny_models import build_tiny_model

from tandem import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path, _ = build_tiny_model("llama-gqa", tmp_path_factory.mktemp("triton-engine"))
    return str(path)


def test_triton_backend_matches_torch_backend(tiny_dir):
    rng = random.Random(0)
    # Mixed lengths, a prompt spanning several blocks, and a shared prefix so
    # the extend path (prefix-cache hit) runs too.
    shared = [rng.randrange(3, 500) for _ in range(10)]
    prompts = [
        [rng.randrange(3, 500) for _ in range(3)],
        [rng.randrange(3, 500) for _ in range(13)],
        shared + [7, 8],
        shared + [9],
    ]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_dir, dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=16,
                  attention_backend=backend)
        assert llm.engine.runner.backend.name == backend
        model = llm.engine.runner.model
        fused = backend == "triton"  # the Triton backend brings the fused layers
        assert model.norm._rms_norm.__module__ == (
            "kernels.rms_norm" if fused else "kernels.reference")
        assert model.layers[0].self_attn.rotary._apply.__module__ == (
            "kernels.rotary" if fused else "kernels.reference")
        # Two rounds: the second hits the prefix cache.
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
        assert any(o.num_cached_tokens > 0 for o in second)
        assert_all_free(llm.engine)
        outputs[backend] = [o.outputs[0].token_ids for o in first]
    assert outputs["triton"] == outputs["torch"]
