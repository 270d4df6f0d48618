"""The 8-bit weight matmul (INT8 / FP8 e4m3 weights with per-row or
per-tensor scales, W8A16) against its torch reference, under the Triton
interpreter here (tests/conftest.py sets TRITON_INTERPRET=1), and the
compressed-tensors layers using it on the Triton backend."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import build_tiny_model

from engine.quantization.compressed import quantize_weight
from engine.quantization.compressed_config import CompressedConfig
from engine.quantization.writer import quantize_model
from kernels import reference
from kernels.scaled_matmul import scaled_matmul
from tandem import LLM, SamplingParams

WEIGHTS = {"int8": CompressedConfig("int", "channel"), "fp8": CompressedConfig("float", "channel"),
           "fp8-tensor": CompressedConfig("float", "tensor")}
# float32 is exact up to summation order; 16-bit outputs round once more.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _layer(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    q, scale = quantize_weight(w, WEIGHTS[name])
    return q, scale.float().reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("m", [1, 5, 33])
def test_kernel_matches_reference(dtype, weights, m):
    k, n = 96, 80  # 80: the last column tile is partial; 96: so is the last input slice
    q, scale = _layer(weights, n, k)
    assert scale.numel() == (1 if weights == "fp8-tensor" else n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = scaled_matmul(x, q, scale, block_n=32, block_k=64)
    ref = reference.scaled_matmul(x.float(), q, scale)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_reference_is_the_dequantized_weight():
    q, scale = _layer("fp8", 16, 32)
    x = torch.randn(3, 32)
    w = q.float() * scale[:, None]
    torch.testing.assert_close(reference.scaled_matmul(x, q, scale), x @ w.T)


def test_strided_rows_and_empty_batches():
    q, scale = _layer("int8", 32, 64)
    wide = torch.randn(6, 128)
    x = wide[:, 64:]  # rows strided, last dim contiguous
    out = scaled_matmul(x, q, scale, block_n=16, block_k=16)
    torch.testing.assert_close(out, reference.scaled_matmul(x, q, scale), atol=1e-5, rtol=1e-5)
    assert scaled_matmul(torch.empty(0, 64), q, scale).shape == (0, 32)


def test_launcher_rejects_bad_input():
    q, scale = _layer("int8", 32, 64)
    x = torch.randn(2, 64)
    for change, message in [
        (dict(x=torch.randn(2, 48)), "weight has 64 input features but x has 48"),
        (dict(weight=q.float()), "weight has dtype"),
        (dict(weight=q.view(torch.uint8)), "weight has dtype"),
        (dict(scale=scale.half()), "scale has dtype"),
        (dict(scale=scale[:5]), "scale has 5 entries"),
        (dict(weight=q.T.contiguous().T), "contiguous last dimension"),
        (dict(block_k=24), "block_k"),
    ]:
        args = dict(x=x, weight=q, scale=scale)
        args.update(change)
        block_k = args.pop("block_k", 64)
        with pytest.raises(ValueError, match=message):
            scaled_matmul(**args, block_k=block_k)


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return build_tiny_model("llama-gqa", tmp_path_factory.mktemp("scaled"))[0]


def _greedy(model_dir, backend: str, **kwargs):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 11)]
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_blocks=32,
              attention_backend=backend, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return out, llm.engine.runner.model.layers[0].mlp.down_proj
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("method", ["int8-w8a16", "fp8"])
def test_compressed_tensors_layers_use_the_kernel_on_the_triton_backend(tiny_src, tmp_path,
                                                                         method):
    """W8A16 and W8A8 (its input quantized in torch first) through the kernel
    give the reference path's tokens."""
    qdir = quantize_model(str(tiny_src), tmp_path / method, method, 8, -1)
    expected, layer = _greedy(qdir, "torch")
    assert layer._kernel is None
    got, layer = _greedy(qdir, "triton")
    assert layer._kernel is scaled_matmul
    assert got == expected
