"""compressed-tensors pack-quantized weights (llm-compressor's W4A16/W8A16):
the words bit by bit, checkpoints written by ``tandem quantize`` loading bit
for bit into QuantLinear, giving their dequantized float twin's tokens, and
splitting across tensor-parallel ranks."""

from __future__ import annotations

import json
import random

import pytest
import torch
from engine_fixtures import assert_all_free
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model

from engine.layers.linear import QuantLinear
from engine.quantization import QuantConfig, packed, quant_config_from_dict
from engine.quantization.compressed_config import packed_config_dict
from engine.quantization.formats import pack_cols
from engine.quantization.writer import is_linear_weight, quantize_model, save_model
from tandem import LLM, SamplingParams

# name: (method, bits, group size); the tiny model's smallest layer has 16 outputs.
SCHEMES = {
    "w4-g32": ("wna16", 4, 32),
    "w8-channel": ("wna16", 8, -1),
    "w4-asym-g32": ("wna16-asym", 4, 32),
    "w8-asym-channel": ("wna16-asym", 8, -1),
}


def _config(bits: int, group_size: int, symmetric: bool) -> QuantConfig:
    return quant_config_from_dict(packed_config_dict(bits, group_size, symmetric))


def test_config_reads_what_the_writer_writes_and_refuses_the_rest():
    cfg = _config(4, 128, True)
    assert cfg == QuantConfig("compressed-tensors", 4, 128, zero_offset=8, stored_zeros=False)
    assert _config(8, -1, False) == QuantConfig("compressed-tensors", 8, -1, zero_offset=128)
    base = packed_config_dict(4, 128, True)
    group = base["config_groups"]["group_0"]
    weights = group["weights"]
    for change, message in [
        ({"input_activations": {"num_bits": 8, "type": "int", "dynamic": True}},
         "quantized input activations"),
        ({"weights": {**weights, "num_bits": 2}}, "int weights of 2 bits"),
        ({"weights": {**weights, "type": "float"}}, "float weights of 4 bits"),
        ({"weights": {**weights, "strategy": "tensor"}}, "strategy 'tensor'"),
        ({"weights": {**weights, "group_size": None}}, "positive group_size"),
        ({"weights": {**weights, "dynamic": True}}, "dynamic"),
    ]:
        with pytest.raises(ValueError, match=message):
            quant_config_from_dict({**base, "config_groups": {"g": {**group, **change}}})
    with pytest.raises(ValueError, match="format 'marlin-24' is not supported"):
        quant_config_from_dict({**base, "format": "marlin-24"})


def test_words_bit_by_bit():
    # A row whose 4-bit integers are -8..7 (one group, absmax 7: scale 1).
    w = torch.arange(-8, 8, dtype=torch.float32).reshape(1, 16).repeat(8, 1)
    w[:, 0] = -7.0  # symmetric: -8 is never produced; the range is -7..7
    t = packed.checkpoint_tensors(_config(4, -1, True), w)
    assert t["weight_packed"].shape == (8, 2) and t["weight_scale"].tolist() == [[1.0]] * 8
    assert t["weight_shape"].tolist() == [8, 16] and "weight_zero_point" not in t
    word = int(t["weight_packed"][0, 0]) & 0xFFFFFFFF
    # Input i of the word sits in bits [4i, 4i + 4) as q + 8.
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [1, 1, 2, 3, 4, 5, 6, 7]
    assert (int(t["weight_packed"][0, 1]) & 0xFFFFFFFF) == sum((8 + i) << (4 * i)
                                                               for i in range(8))
    # Asymmetric zero points pack down the output rows: row r of a word group at bits 4r.
    w = torch.rand(8, 16) + torch.arange(8, dtype=torch.float32)[:, None]  # all positive
    q, scale, zero = packed.quantize(w, 4, -1, symmetric=False)
    assert zero.flatten().tolist() == [-8] * 8  # min clamps to 0, the lowest level
    zp = packed.checkpoint_tensors(_config(4, -1, False), w)["weight_zero_point"]
    assert zp.shape == (1, 1) and int(zp) == 0  # every nibble -8 + 8
    assert torch.equal(packed.dequantize(q, scale, zero), (q.float() + 8) * scale.float())


@pytest.mark.parametrize("name", list(SCHEMES))
def test_layer_loads_the_words_unchanged_and_dequantizes_to_the_twin(name):
    method, bits, group = SCHEMES[name]
    cfg = _config(bits, group, method == "wna16")
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(bits))
    tensors = packed.checkpoint_tensors(cfg, w)
    layer = _layer(cfg, tensors)
    assert torch.equal(layer.qweight, tensors["weight_packed"].T)
    q, scale, zero = packed.quantize(w, bits, group, method == "wna16")
    twin = packed.dequantize(q, scale, zero)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ twin.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.zeros, (zero.float() + cfg.zero_offset).T)


def _layer(cfg: QuantConfig, tensors: dict[str, torch.Tensor]) -> QuantLinear:
    out, k = tensors["weight_shape"].tolist()
    layer = QuantLinear(k, out, False, cfg, fused=False)
    with torch.no_grad():
        for name, tensor in tensors.items():
            converted = layer.checkpoint_tensor(name, tensor)
            if converted is not None:
                getattr(layer, converted[0]).copy_(converted[1])
    return layer


def test_act_order_group_indices_and_unpacked_zero_points():
    """``weight_g_idx`` names each input's group; int8 zero points are read
    one per element."""
    cfg = QuantConfig("compressed-tensors", 4, 16, desc_act=True, zero_offset=8)
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (16, 32), generator=gen, dtype=torch.int8)
    scale, zero = torch.rand(16, 2, generator=gen), torch.randint(-3, 3, (16, 2), dtype=torch.int8)
    g_idx = (torch.arange(32) // 16)[torch.randperm(32, generator=gen)].int()
    twin = (q.float() - zero.float()[:, g_idx.long()]) * scale[:, g_idx.long()]
    layer = _layer(cfg, {"weight_packed": pack_cols(q.int() + 8, 4), "weight_scale": scale,
                         "weight_zero_point": zero, "weight_g_idx": g_idx,
                         "weight_shape": torch.tensor([16, 32])})
    x = torch.randn(2, 32, generator=gen)
    torch.testing.assert_close(layer(x), x @ twin.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"weight_shape \[16, 48\] does not match"):
        layer.checkpoint_tensor("weight_shape", torch.tensor([16, 48]))
    with pytest.raises(ValueError, match="'weight' is not a tensor of a compressed-tensors"):
        layer.checkpoint_tensor("weight", q.float())


# ---- whole models -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    return {name: build_tiny_model(name, root)[0] for name in ("llama-gqa", "qwen2")}


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory):
    """Each scheme's checkpoint of the llama model, written once."""
    root = tmp_path_factory.mktemp("packed-out")
    return {name: quantize_model(str(tiny["llama-gqa"]), root / name, *SCHEMES[name])
            for name in SCHEMES}


def greedy(model_dir, **kwargs) -> list[list[int]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 11, 19)]
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_blocks=64, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_all_free(llm.engine)
        return out
    finally:
        llm.engine.shutdown()


def _unpack(words: torch.Tensor, bits: int, along_rows: bool) -> torch.Tensor:
    """Signed integers out of int32 words, value ``i`` of a word at bits
    ``[i * bits, (i + 1) * bits)``, offset by ``2**(bits-1)``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = ((words[..., None] >> shifts) & ((1 << bits) - 1)) - (1 << (bits - 1))
    r, c, pack = vals.shape
    return vals.permute(0, 2, 1).reshape(r * pack, c) if along_rows else vals.reshape(r, c * pack)


def _twin(src, qdir, out):
    """The float model of ``qdir``'s integers, decoded here, not by the loader."""
    q, f = load_file(qdir / "model.safetensors"), load_file(src / "model.safetensors")
    cfg = json.loads((qdir / "config.json").read_text())["quantization_config"]
    bits = cfg["config_groups"]["group_0"]["weights"]["num_bits"]
    twin = {}
    for name, tensor in f.items():
        prefix = name.removesuffix(".weight")
        if not is_linear_weight(name):
            twin[name] = tensor
            continue
        ints = _unpack(q[f"{prefix}.weight_packed"], bits, along_rows=False)
        scale = q[f"{prefix}.weight_scale"]
        zp = q.get(f"{prefix}.weight_zero_point")
        zero = torch.zeros(scale.shape) if zp is None else _unpack(zp, bits, along_rows=True)
        twin[name] = packed.dequantize(ints, scale, zero).contiguous()
    return save_model(src, out, twin, {})


@pytest.mark.parametrize("name", list(SCHEMES))
def test_model_gives_its_dequantized_twins_tokens(tiny, written, name, tmp_path):
    qdir = written[name]
    weights = load_file(qdir / "model.safetensors")
    assert weights["model.layers.0.mlp.down_proj.weight_packed"].dtype == torch.int32
    assert ("model.layers.0.mlp.down_proj.weight_zero_point" in weights) == ("asym" in name)
    assert greedy(qdir) == greedy(_twin(tiny["llama-gqa"], qdir, tmp_path / "twin"))


def test_qwen2_biases_ride_along(tiny, tmp_path):
    qdir = quantize_model(str(tiny["qwen2"]), tmp_path / "q", "wna16-asym", 4, 32)
    assert greedy(qdir) == greedy(_twin(tiny["qwen2"], qdir, tmp_path / "twin"))


def test_two_ranks_give_the_tokens_of_one(written):
    """Column-parallel layers split the packed columns and zero points;
    row-parallel ones split the packed rows and keep every group's scales."""
    qdir = written["w4-asym-g32"]
    assert greedy(qdir, tensor_parallel_size=2) == greedy(qdir)


def test_bad_checkpoints_are_refused(written, tmp_path):
    weights = load_file(written["w4-g32"] / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight_shape"
    bad = tmp_path / "bad"
    save_model(written["w4-g32"], bad, {**weights, key: torch.tensor([128, 96])},
               {"quantization_config": packed_config_dict(4, 32, True)})
    with pytest.raises(ValueError, match=r"weight_shape \[128, 96\] does not match"):
        LLM(str(bad), num_blocks=8)
    del weights["model.layers.1.self_attn.v_proj.weight_scale"]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights, e.g. \['layers.1.self_attn.qkv_proj"):
        LLM(str(bad), num_blocks=8)


def test_tandem_quantize_writes_pack_quantized(tiny, tmp_path, capsys):
    from tandem.cli import main

    out = tmp_path / "w8"
    assert main(["quantize", str(out), "--model", str(tiny["llama-gqa"]), "--method", "wna16",
                 "--bits", "8", "--group-size", "-1"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized" and cfg["quant_method"] == "compressed-tensors"
    assert cfg["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    weights = load_file(out / "model.safetensors")
    assert weights["model.layers.0.mlp.up_proj.weight_packed"].shape == (128, 16)
    assert weights["model.layers.0.mlp.up_proj.weight_scale"].shape == (128, 1)
    assert LLM(str(out), num_blocks=8, quantization="compressed-tensors") is not None
    assert main(["quantize", str(tmp_path / "b"), "--model", str(tiny["llama-gqa"]),
                 "--method", "wna16", "--bits", "3"]) == 2
    assert "int weights of 3 bits" in capsys.readouterr().err
