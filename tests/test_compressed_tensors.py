"""8-bit FP8/INT8 weights: compressed-tensors checkpoints written by
``tandem quantize`` load bit for bit, give their dequantized float twin's
tokens, split across tensor-parallel ranks, and ``quantization="fp8"`` of a
float model equals the FP8 checkpoint of it."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from engine_fixtures import assert_all_free
from safetensors.torch import load_file
from tiny_models import build_tiny_model

from engine.quantization.compressed import dequantize_weight, fake_quantize_input
from engine.quantization.compressed_config import SCHEMES, CompressedConfig
from engine.quantization.writer import is_linear_weight, quantize_model, save_model
from tandem import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    path, _ = build_tiny_model("llama-gqa", tmp_path_factory.mktemp("ct"))
    return path


@pytest.fixture(scope="module")
def quantized(tiny_src, tmp_path_factory):
    """Each scheme's checkpoint, written once: method -> directory."""
    root = tmp_path_factory.mktemp("ct-out")
    return {m: quantize_model(str(tiny_src), root / m, m, 8, -1) for m in SCHEMES}


def greedy(model_dir, **kwargs) -> list[list[int]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 11, 19)]
    kwargs.setdefault("dtype", "float32")
    llm = LLM(str(model_dir), block_size=4, num_blocks=64, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_all_free(llm.engine)
        return out
    finally:
        llm.engine.shutdown()


def test_quantization_config_round_trips_and_refuses_what_is_not_read():
    for weight_type, strategy, acts in SCHEMES.values():
        cfg = CompressedConfig(weight_type, strategy, acts)
        assert CompressedConfig.from_dict(cfg.to_dict()) == cfg
    base = CompressedConfig("int", "channel", "token").to_dict()
    group = base["config_groups"]["group_0"]
    for change, message in [
        ({"format": "marlin-24"}, "format 'marlin-24' is not supported"),
        ({"config_groups": {"a": group, "b": group}}, "2 config groups"),
        ({"config_groups": {"g": {**group, "weights": {**group["weights"], "num_bits": 4}}}},
         "4-bit compressed-tensors weights"),
        ({"config_groups": {"g": {**group, "input_activations": {
            **group["input_activations"], "dynamic": False}}}}, "static input activation"),
        ({"config_groups": {"g": {**group, "weights": {**group["weights"], "symmetric": False}}}},
         "only symmetric"),
        ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "leave decoder layers"),
    ]:
        with pytest.raises(ValueError, match=message):
            CompressedConfig.from_dict({**base, **change})


@pytest.mark.parametrize("method", list(SCHEMES))
def test_checkpoint_is_the_rounded_weight_and_loads_bit_for_bit(tiny_src, quantized, method):
    src = load_file(tiny_src / "model.safetensors")
    out = load_file(quantized[method] / "model.safetensors")
    cfg = CompressedConfig(*SCHEMES[method])
    config = json.loads((quantized[method] / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    name = "model.layers.1.mlp.down_proj"
    q, scale = out[f"{name}.weight"], out[f"{name}.weight_scale"]
    assert q.dtype == (torch.float8_e4m3fn if cfg.weight_type == "float" else torch.int8)
    assert scale.shape == ((q.shape[0], 1) if cfg.strategy == "channel" else (1,))
    err = (dequantize_weight(q, scale) - src[f"{name}.weight"].float()).abs()
    step = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float()
    # int8: within half a step; e4m3: within 2**-4 relative to the row's largest value.
    bound = 0.5 * step if cfg.weight_type == "int" else 448 * step * 2**-4
    assert bool((err <= bound + 1e-7).all())
    llm = LLM(str(quantized[method]), dtype="float32", num_blocks=8, block_size=4)
    layers = llm.engine.runner.model.layers
    down = layers[1].mlp.down_proj
    assert type(down).__name__ == "ScaledLinear"
    assert torch.equal(down.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(down.weight_scale, scale.float().reshape(-1).expand(q.shape[0]))
    # A fused layer: k_proj's rows follow q_proj's, each with its own scale.
    qkv = layers[0].self_attn.qkv_proj
    kq, ks = out["model.layers.0.self_attn.k_proj.weight"], out[
        "model.layers.0.self_attn.k_proj.weight_scale"]
    rows = out["model.layers.0.self_attn.q_proj.weight"].shape[0]
    k_rows = slice(rows, rows + kq.shape[0])
    assert torch.equal(qkv.weight[k_rows].view(torch.uint8), kq.view(torch.uint8))
    assert torch.equal(qkv.weight_scale[k_rows], ks.float().reshape(-1).expand(kq.shape[0]))


@pytest.mark.parametrize("method", ["fp8-w8a16", "fp8-tensor", "int8-w8a16"])
def test_weight_only_model_gives_its_dequantized_twins_tokens(tiny_src, quantized, method,
                                                             tmp_path):
    out = load_file(quantized[method] / "model.safetensors")
    src = load_file(tiny_src / "model.safetensors")
    twin = {n: dequantize_weight(out[n], out[n + "_scale"]) if is_linear_weight(n) else t
            for n, t in src.items()}
    twin_dir = save_model(tiny_src, tmp_path / "twin", {k: v.contiguous() for k, v in twin.items()},
                          {})
    assert greedy(quantized[method]) == greedy(twin_dir)


def test_dynamic_input_quantization():
    x = torch.tensor([[1.0, -0.5, 0.25], [100.0, 3.0, -7.0]])
    per_token = fake_quantize_input(x, CompressedConfig("int", "channel", "token"))
    assert per_token[0, 0] == 1.0 and per_token[1, 0] == 100.0  # each row's max is exact
    assert torch.allclose(per_token, x, atol=100 / 127 / 2 + 1e-6)
    per_tensor = fake_quantize_input(x, CompressedConfig("int", "channel", "tensor"))
    assert per_tensor[0, 2] == 0.0  # 0.25 is under half of the tensor's step (100/127)
    fp8 = fake_quantize_input(x, CompressedConfig("float", "channel", "token"))
    assert fp8[1, 0] == 100.0 and torch.allclose(fp8, x, rtol=2**-4)


def test_online_fp8_equals_the_fp8_checkpoint_of_the_same_model(tiny_src, quantized):
    assert greedy(tiny_src, quantization="fp8") == greedy(quantized["fp8"])
    assert greedy(quantized["fp8"], quantization="fp8") == greedy(quantized["fp8"])
    with pytest.raises(ValueError, match="quantization='fp8' was asked for, but .* is "
                                         "compressed-tensors-quantized"):
        LLM(str(quantized["int8"]), num_blocks=8, quantization="fp8")


@pytest.mark.parametrize("method", ["int8-w8a16", "fp8-tensor"])
def test_two_ranks_give_the_tokens_of_one(quantized, method):
    # Weight-only schemes: a W8A8 row-split layer quantizes each rank's slice
    # of its input with that slice's own per-token scale (as vLLM does), so
    # its output is close to one rank's but not the same bits.
    assert greedy(quantized[method], tensor_parallel_size=2) == greedy(quantized[method])


def test_w8a8_runs_split_across_two_ranks(quantized):
    tokens = greedy(quantized["int8"], tensor_parallel_size=2)
    assert [len(t) for t in tokens] == [6, 6, 6]


def test_tandem_quantize_writes_compressed_tensors(tiny_src, tmp_path, capsys):
    from tandem.cli import main

    out = tmp_path / "int8"
    assert main(["quantize", str(out), "--model", str(tiny_src), "--method", "int8"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    weights = load_file(out / "model.safetensors")
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
    assert weights["model.embed_tokens.weight"].is_floating_point()
    assert LLM(str(out), num_blocks=8, quantization="compressed-tensors") is not None


def test_int8_weights_under_bf16_decode_rows_take_the_int8_gemv():
    """A few bfloat16 rows go through torch's int8 GEMV (sum over the exact
    integers, bf16 scale); more rows, other dtypes, and widths the op cannot
    take (not a multiple of 32: it returns garbage there) dequantize."""
    from engine.layers.scaled_linear import INT8_GEMV_MAX_ROWS, ScaledLinear
    from engine.quantization.compressed import quantize_weight
    from kernels import reference

    torch.manual_seed(0)
    for in_features, gemv in ((96, True), (40, False)):
        cfg = CompressedConfig("int", "channel")
        layer = ScaledLinear(in_features, 48, False, cfg)
        assert layer._int8_gemv == gemv
        q, scale = quantize_weight(torch.randn(48, in_features) * 0.1, cfg)
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale.reshape(-1))
        for rows in (1, 5, INT8_GEMV_MAX_ROWS, INT8_GEMV_MAX_ROWS + 1):
            x = torch.randn(rows, in_features).bfloat16()
            out = layer(x)
            dequantized = F.linear(x, dequantize_weight(q, scale).bfloat16())
            if gemv and rows <= INT8_GEMV_MAX_ROWS:
                assert torch.equal(out, torch._weight_int8pack_mm(x, q, scale.reshape(-1).bfloat16()))
            else:
                assert torch.equal(out, dequantized)
            ref = reference.scaled_matmul(x.float(), q, scale.reshape(-1)).float()
            torch.testing.assert_close(out.float(), ref, atol=1e-2 * ref.abs().max().item(),
                                       rtol=1e-2)
        x = torch.randn(2, in_features)  # float32 inputs: the reference
        assert torch.equal(layer(x), F.linear(x, dequantize_weight(q, scale)))


def test_bf16_int8_model_gives_its_dequantized_twins_tokens(tiny_src, quantized, tmp_path):
    out = load_file(quantized["int8-w8a16"] / "model.safetensors")
    src = load_file(tiny_src / "model.safetensors")
    twin = {n: dequantize_weight(out[n], out[n + "_scale"]) if is_linear_weight(n) else t
            for n, t in src.items()}
    twin_dir = save_model(tiny_src, tmp_path / "twin", {k: v.contiguous() for k, v in twin.items()},
                          {})
    assert greedy(quantized["int8-w8a16"], dtype="bfloat16") == greedy(twin_dir, dtype="bfloat16")
