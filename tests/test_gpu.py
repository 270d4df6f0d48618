"""Checks that need a CUDA device: compiled Triton kernels and the engine on
the GPU. Skipped (not faked) without one. Run on a GPU machine with

    TRITON_INTERPRET=0 pytest -m gpu tests/test_gpu.py
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="set TRITON_INTERPRET=0 to compile the kernels for the GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_decode_kernel_matches_reference(dtype):
    from kernels import reference
    from kernels.decode_attention import paged_decode_attention

    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, heads, dim = 256, 16, 8, 32, 128
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    seq_lens = torch.tensor([1, 15, 16, 17, 700], device="cuda", dtype=torch.int32)
    tables = torch.randperm(num_blocks, device="cuda")[: 5 * 48].view(5, 48).int()
    query = torch.randn(5, heads, dim, device="cuda", dtype=dtype)
    out = paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, dim**-0.5)
    ref = reference.paged_decode_attention(query.float(), k_cache.float(), v_cache.float(),
                                           tables, seq_lens, dim**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_engine_on_gpu_matches_cpu(tmp_path):
    from tiny_models import build_tiny_model

    from tandem import LLM, SamplingParams

    model_dir, _ = build_tiny_model("llama-gqa", tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        # float32 on both: "auto" is bfloat16 on either device, where the two
        # devices' kernels may round a near-tie apart.
        llm = LLM(str(model_dir), device=device, dtype="float32", num_blocks=64, block_size=16)
        outputs[device] = [o.outputs[0].token_ids
                           for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["cuda"] == outputs["cpu"]


def test_decode_cuda_graphs_match_eager(tmp_path):
    from tiny_models import build_tiny_model

    from tandem import LLM, SamplingParams

    model_dir, _ = build_tiny_model("llama-gqa", tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 40, 9, 25)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 12, 7, 9, 3)]
    outputs = {}
    for eager in (True, False):
        llm = LLM(str(model_dir), device="cuda", num_blocks=64, block_size=16,
                  max_num_seqs=16, max_model_len=128, enforce_eager=eager)
        graphs = llm.engine.runner.decode_graphs
        assert (graphs is None) == eager
        if graphs is not None:
            assert sorted(graphs.graphs) == [1, 2, 4, 8, 16]
        outputs[eager] = [o.outputs[0].token_ids
                          for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs[False] == outputs[True]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_quant_matmul_matches_reference(dtype):
    from kernels import reference
    from kernels.quant_matmul import quant_matmul

    torch.manual_seed(0)
    k, n, group = 4096, 1024, 128
    qweight = torch.randint(-(1 << 31), (1 << 31) - 1, (k // 8, n), dtype=torch.int32,
                            device="cuda")
    scales = (torch.rand(k // group, n, device="cuda") * 0.01).to(dtype)
    zeros = torch.randint(0, 16, (k // group, n), device="cuda").to(dtype)
    in_order = torch.arange(k, device="cuda", dtype=torch.int32) // group
    act_order = in_order[torch.randperm(k, device="cuda")]
    for g_idx, rows in ((act_order, 0), (in_order, 0), (in_order, group)):
        for m in (1, 7, 64, 300):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            out = quant_matmul(x, qweight, scales, zeros, g_idx, 4, uniform_rows=rows)
            ref = reference.quant_matmul(x.float(), qweight, scales.float(), zeros.float(),
                                         g_idx, 4)
            torch.testing.assert_close(out.float(), ref, atol=3e-2 * ref.abs().max().item(),
                                       rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weights", [torch.int8, torch.float8_e4m3fn])
def test_compiled_scaled_matmul_matches_reference(dtype, weights):
    from kernels import reference
    from kernels.scaled_matmul import scaled_matmul

    torch.manual_seed(0)
    k, n = 4096, 1024
    w = (torch.randn(n, k, device="cuda") * 40).clamp(-127, 127)
    w = w.round().to(weights) if weights == torch.int8 else w.to(weights)
    for scale in (torch.rand(n, device="cuda") * 0.01, torch.full((1,), 0.003, device="cuda")):
        for m in (1, 7, 64, 300):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            out = scaled_matmul(x, w, scale)
            ref = reference.scaled_matmul(x.float(), w, scale)
            torch.testing.assert_close(out.float(), ref, atol=1e-2 * ref.abs().max().item(),
                                       rtol=1e-2)


@pytest.mark.parametrize("method,bits,group", [("int8-w8a16", 8, -1), ("fp8", 8, -1),
                                               ("wna16", 4, 32)])
def test_compressed_tensors_models_on_gpu_match_cpu(tmp_path, method, bits, group):
    """8-bit layers through kernels.scaled_matmul, pack-quantized ones through
    kernels.quant_matmul, give the CPU reference's tokens."""
    from tiny_models import build_tiny_model

    from engine.quantization.writer import quantize_model
    from tandem import LLM, SamplingParams

    src, _ = build_tiny_model("llama-gqa", tmp_path)
    qdir = quantize_model(str(src), tmp_path / method, method, bits, group)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(qdir), device=device, dtype="float32", num_blocks=64, block_size=16)
        layer = llm.engine.runner.model.layers[0].mlp.down_proj
        if device == "cuda":
            fused = getattr(layer, "_kernel", None) or layer._matmul
            assert fused.__module__ in ("kernels.scaled_matmul", "kernels.quant_matmul")
        outputs[device] = [o.outputs[0].token_ids
                           for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.shutdown()
    assert outputs["cuda"] == outputs["cpu"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_over_nccl_matches_one_gpu(tmp_path):
    from tiny_models import build_tiny_model

    from tandem import LLM, SamplingParams

    model_dir, _ = build_tiny_model("llama-gqa", tmp_path)
    prompts = [[5, 6, 7], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for tp in (1, 2):
        llm = LLM(str(model_dir), device="cuda", num_blocks=64, tensor_parallel_size=tp)
        try:
            outputs[tp] = [o.outputs[0].token_ids
                           for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()
    assert outputs[2] == outputs[1]


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_compiled_fp8_store_and_decode_match_reference(fp8):
    from kernels import reference
    from kernels.decode_attention import paged_decode_attention
    from kernels.store_kv import store_kv

    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, heads, dim = 64, 16, 4, 16, 128
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, device="cuda", dtype=fp8)
    v_cache = torch.zeros_like(k_cache)
    n = num_blocks * block_size
    key = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16) * 20
    value = torch.randn_like(key)
    slots = torch.randperm(n, device="cuda")
    k_ref_cpu, v_ref_cpu = k_cache.cpu(), v_cache.cpu()
    reference.store_kv(key.cpu(), value.cpu(), k_ref_cpu, v_ref_cpu, slots.cpu(), 0.5, 2.0)
    store_kv(key, value, k_cache, v_cache, slots, k_scale=0.5, v_scale=2.0)
    assert torch.equal(k_cache.cpu().view(torch.uint8), k_ref_cpu.view(torch.uint8))
    assert torch.equal(v_cache.cpu().view(torch.uint8), v_ref_cpu.view(torch.uint8))
    seq_lens = torch.tensor([1, 15, 17, 250], device="cuda", dtype=torch.int32)  # <= 16 blocks
    tables = torch.randperm(num_blocks, device="cuda")[: 4 * 16].view(4, 16).int()
    query = torch.randn(4, heads, dim, device="cuda", dtype=torch.bfloat16)
    out = paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, dim**-0.5,
                                 k_scale=0.5, v_scale=2.0)
    ref = reference.paged_decode_attention(query.float(), k_cache, v_cache, tables, seq_lens,
                                           dim**-0.5, 0.5, 2.0)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_cpu_offload_streams_layers_and_keeps_the_tokens(tmp_path):
    from tiny_models import build_tiny_model

    from engine.weight_offload import GB, param_bytes
    from tandem import LLM, SamplingParams

    model_dir, _ = build_tiny_model("llama-gqa", tmp_path)
    prompts = [[5, 6, 7], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for offload in (False, True):
        probe = LLM(str(model_dir), device="cuda", num_blocks=64, block_size=16)
        layer_bytes = param_bytes(probe.engine.runner.model.layers[0])
        del probe
        gb = layer_bytes / GB if offload else 0.0  # the first of the tiny model's two layers
        llm = LLM(str(model_dir), device="cuda", num_blocks=64, block_size=16, cpu_offload_gb=gb)
        shard = llm.engine.runner.shard
        if offload:
            assert shard.offload.num_layers == 1 and llm.engine.runner.decode_graphs is None
        outputs[offload] = [o.outputs[0].token_ids
                            for o in llm.generate(prompts, params, use_tqdm=False)]
        if offload:  # between forwards the offloaded weights are pinned host tensors
            for p in shard.model.layers[0].parameters():
                assert p.device.type == "cpu" and p.is_pinned()
            assert next(shard.model.layers[1].parameters()).device.type == "cuda"
    assert outputs[True] == outputs[False]
