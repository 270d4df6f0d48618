"""GPTQ and AWQ: the checkpoint formats bit by bit, the quantized matmul
kernel against its reference, and whole quantized models giving the tokens of
the same model with the dequantized weights in float."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from engine_fixtures import assert_all_free
from safetensors.torch import load_file, save_file
from tiny_models import AWQ, GPTQ, build_tiny_model, quantize_checkpoint

from engine.quantization import QuantConfig
from engine.quantization.formats import (
    AWQ_ORDER,
    checkpoint_tensors,
    pack_cols,
    pack_rows,
    quantize_rtn,
    to_tandem,
    unpack_cols,
)
from kernels import reference
from kernels.quant_matmul import quant_matmul, uniform_group_rows
from tandem import LLM, SamplingParams


def _nibble(word: torch.Tensor, i: int, bits: int = 4) -> int:
    return (int(word) >> (i * bits)) & ((1 << bits) - 1)


# ---- formats ------------------------------------------------------------------


def test_pack_and_unpack_are_inverse():
    torch.manual_seed(0)
    for bits in (4, 8):
        values = torch.randint(0, 1 << bits, (32, 16), dtype=torch.int32)
        assert torch.equal(reference.unpack_int_rows(pack_rows(values, bits), bits), values)
        assert torch.equal(unpack_cols(pack_cols(values, bits), bits), values)
    # The top nibble set: the word is negative as an int32 and still unpacks.
    word = pack_rows(torch.full((8, 1), 15, dtype=torch.int32), 4)
    assert word.item() == -1
    with pytest.raises(ValueError, match="do not pack"):
        pack_rows(torch.zeros(7, 2, dtype=torch.int32), 4)


def test_gptq_layout_bit_by_bit():
    """Word r of qweight holds input rows 8r..8r+7 from the low bits; the zero
    points are stored minus one, packed along the output columns."""
    quant = QuantConfig.from_dict(GPTQ)
    torch.manual_seed(1)
    weight = torch.randn(16, 64)  # nn.Linear layout: [out, in]
    ck = checkpoint_tensors(quant, weight)
    q, _, zeros, _ = quantize_rtn(weight, 4, 32, min_zero=1)
    assert ck["qweight"].shape == (8, 16) and ck["qzeros"].shape == (2, 2)
    for i in range(8):
        assert _nibble(ck["qweight"][1, 5], i) == q[8 + i, 5]
        assert _nibble(ck["qzeros"][1, 0], i) == zeros[1, i] - 1
    assert ck["g_idx"].tolist() == [k // 32 for k in range(64)]


def test_awq_layout_bit_by_bit():
    """qweight is [in, out / 8]; nibble i of a word holds column AWQ_ORDER[i]
    of its eight; zero points the same way, not offset."""
    quant = QuantConfig.from_dict(AWQ)
    torch.manual_seed(2)
    weight = torch.randn(16, 64)
    q, _, zeros, _ = quantize_rtn(weight, 4, 32)
    ck = checkpoint_tensors(quant, weight)
    assert ck["qweight"].shape == (64, 2) and ck["qzeros"].shape == (2, 2)
    assert "g_idx" not in ck
    for i in range(8):
        assert _nibble(ck["qweight"][3, 1], i) == q[3, 8 + AWQ_ORDER[i]]
        assert _nibble(ck["qzeros"][1, 0], i) == zeros[1, AWQ_ORDER[i]]


@pytest.mark.parametrize("cfg", [GPTQ, {**GPTQ, "bits": 8}, {**GPTQ, "group_size": -1}, AWQ,
                                 {**GPTQ, "checkpoint_format": "gptq_v2"}])
def test_checkpoint_converts_to_the_rounded_weight(cfg):
    quant = QuantConfig.from_dict(cfg)
    torch.manual_seed(3)
    weight = torch.randn(24, 64)
    tensors = dict(to_tandem(quant, name, t) for name, t in checkpoint_tensors(quant, weight).items())
    g_idx = tensors.get("g_idx", torch.arange(64, dtype=torch.int32) // quant.group_of(64))
    w = reference.dequantize(tensors["qweight"], tensors["scales"].float(),
                             tensors["zeros"].float(), g_idx, quant.bits)
    scales = tensors["scales"].float()[g_idx.long()]
    # Round to nearest: within half a step of the float weight (plus fp16 scales).
    assert ((w - weight.T).abs() <= scales * 0.5 + 1e-3).all()


@pytest.mark.parametrize("cfg", [GPTQ, AWQ])
def test_a_group_without_negative_weights_round_trips(cfg):
    """Its zero point would be 0, which GPTQ's original format (zero - 1 in
    four bits) cannot store: the writer keeps zeros >= 1 there."""
    quant = QuantConfig.from_dict(cfg)
    torch.manual_seed(4)
    weight = torch.rand(16, 64)  # all >= 0
    tensors = dict(to_tandem(quant, name, t) for name, t in checkpoint_tensors(quant, weight).items())
    g_idx = torch.arange(64, dtype=torch.int32) // 32
    w = reference.dequantize(tensors["qweight"], tensors["scales"].float(),
                             tensors["zeros"].float(), g_idx, quant.bits)
    step = tensors["scales"].float()[g_idx.long()]
    assert ((w - weight.T).abs() <= step * 0.5 + 1e-3).all()


def test_quant_config_reads_and_refuses():
    assert QuantConfig.from_dict(GPTQ).zero_offset == 1
    assert QuantConfig.from_dict({**GPTQ, "checkpoint_format": "gptq_v2"}).zero_offset == 0
    assert QuantConfig.from_dict(AWQ) == QuantConfig("awq", 4, 32)
    for cfg, message in [
        ({**GPTQ, "bits": 3}, "3-bit"),
        ({**AWQ, "bits": 8}, "8-bit"),
        ({**AWQ, "version": "gemv"}, "gemv"),
        ({**AWQ, "zero_point": False}, "zero points"),
        ({**GPTQ, "lm_head": True}, "lm_head"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
        ({**GPTQ, "group_size": 0}, "group_size"),
    ]:
        with pytest.raises(ValueError, match=message):
            QuantConfig.from_dict(cfg)


# ---- the kernel ---------------------------------------------------------------


def _random_layer(k: int, n: int, bits: int, group: int, dtype, act_order: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int32)
    groups = k // group
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=gen).to(dtype)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return pack_rows(values, bits), scales, zeros, g_idx


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2),
                                       (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("uniform_rows,block_k", [(0, 32), (32, 32), (32, 64)],
                         ids=["per-row", "slice-wise", "slice-wider-than-a-group"])
def test_kernel_matches_reference(dtype, tol, bits, m, uniform_rows, block_k):
    """Scales per input row, once per slice, and a slice wider than the
    caller's uniform run, which must fall back to per-row scales."""
    k, n, group = 128, 80, 32  # 80: the last column tile is partial
    qweight, scales, zeros, g_idx = _random_layer(k, n, bits, group, dtype, act_order=False)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = quant_matmul(x, qweight, scales, zeros, g_idx, bits, block_n=32, block_k=block_k,
                       uniform_rows=uniform_rows)
    ref = reference.quant_matmul(x.float(), qweight, scales.float(), zeros.float(), g_idx, bits)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_kernel_act_order_and_non_contiguous_input():
    k, n = 64, 32
    qweight, scales, zeros, g_idx = _random_layer(k, n, 4, 16, torch.float32, act_order=True)
    wide = torch.randn(6, 2 * k)
    x = wide[:, :k]  # rows strided, last dim contiguous
    out = quant_matmul(x, qweight, scales, zeros, g_idx, 4, block_n=16, block_k=16)
    ref = reference.quant_matmul(x, qweight, scales, zeros, g_idx, 4)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_uniform_group_rows_finds_the_longest_aligned_run_of_one_group():
    rows = torch.arange(512, dtype=torch.int32)
    assert uniform_group_rows(rows // 128) == 128
    assert uniform_group_rows(rows // 256) == 128  # capped at the longest slice
    assert uniform_group_rows(rows // 32) == 32
    assert uniform_group_rows(rows // 8) == 0  # groups shorter than any slice
    assert uniform_group_rows((rows // 128)[torch.randperm(512)]) == 0  # act order
    assert uniform_group_rows((rows // 64)[:96]) == 32  # 96 rows: no whole 64-row slice


def test_default_launch_with_in_order_and_act_order_groups():
    """Without tile arguments: decode-sized and prefill-sized inputs, groups in
    order (scales per slice) and in act order (per row), all exact."""
    for act_order in (False, True):
        qweight, scales, zeros, g_idx = _random_layer(256, 48, 4, 64, torch.float32, act_order)
        rows = uniform_group_rows(g_idx)
        assert rows == (0 if act_order else 64)
        for m in (1, 20):
            x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
            out = quant_matmul(x, qweight, scales, zeros, g_idx, 4, uniform_rows=rows)
            ref = reference.quant_matmul(x, qweight, scales, zeros, g_idx, 4)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_kernel_launcher_errors():
    qweight, scales, zeros, g_idx = _random_layer(64, 32, 4, 32, torch.float32, False)
    x = torch.randn(2, 64)
    for kwargs, message in [
        (dict(bits=3), "bits"),
        (dict(x=torch.randn(2, 48)), "input features"),
        (dict(qweight=qweight.float()), "qweight has dtype"),
        (dict(zeros=zeros[:, :16]), "must both be"),
        (dict(g_idx=g_idx[:10]), "g_idx"),
        (dict(block_k=24), "block_k"),
    ]:
        args = dict(x=x, qweight=qweight, scales=scales, zeros=zeros, g_idx=g_idx, bits=4)
        args.update(kwargs)
        block_k = args.pop("block_k", 64)
        with pytest.raises(ValueError, match=message):
            quant_matmul(**args, block_k=block_k)


# ---- whole models -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    path, _ = build_tiny_model("llama-gqa", tmp_path_factory.mktemp("quant"))
    return path


def _greedy(model_dir, backend="torch", **kwargs):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 11, 19)]
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_blocks=64,
              attention_backend=backend, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_all_free(llm.engine)
    return out, llm


@pytest.mark.parametrize("name,cfg,act_order", [
    ("gptq", GPTQ, False),
    ("gptq-act-order", {**GPTQ, "desc_act": True}, True),
    ("gptq-8bit", {**GPTQ, "bits": 8}, False),
    ("awq", AWQ, False),
])
def test_quantized_model_matches_its_dequantized_float_twin(tiny_src, tmp_path, name, cfg,
                                                            act_order):
    qdir, fdir = quantize_checkpoint(tiny_src, tmp_path / name, cfg, act_order)
    expected, _ = _greedy(fdir)
    got, llm = _greedy(qdir)
    assert got == expected
    attn = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert type(attn).__name__ == "QuantLinear" and attn.qweight.dtype == torch.int32
    assert not any(p.is_floating_point() and p.dim() == 2 and "proj" in n and "scales" not in n
                   and "zeros" not in n for n, p in llm.engine.runner.model.named_parameters())


def test_quantized_model_on_the_triton_backend(tiny_src, tmp_path):
    """The fused kernel (under the interpreter) gives the reference's tokens."""
    qdir, _ = quantize_checkpoint(tiny_src, tmp_path / "awq", AWQ)
    expected, _ = _greedy(qdir, "torch")
    got, llm = _greedy(qdir, "triton")
    assert got == expected
    down = llm.engine.runner.model.layers[0].mlp.down_proj
    assert down._matmul.__module__ == "kernels.quant_matmul"
    assert down._uniform_rows == AWQ["group_size"]  # in order: scales loaded once per slice


def test_bad_quantized_checkpoints_are_refused(tiny_src, tmp_path):
    # Groups of 48 do not divide the 64 hidden features.
    bad = tmp_path / "bad-group"
    shutil.copytree(tiny_src, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config":
                                                 {**GPTQ, "group_size": 48}}))
    with pytest.raises(ValueError, match="multiple of the group size"):
        LLM(str(bad), num_blocks=16)
    # A float checkpoint under a quantization_config lacks every quantized tensor.
    with pytest.raises(ValueError, match="'weight' is not a tensor of a gptq linear layer"):
        LLM(str(_with_config(tiny_src, tmp_path)), num_blocks=16)
    # g_idx that differs between q, k and v cannot share one fused layer.
    qdir, _ = quantize_checkpoint(tiny_src, tmp_path / "act", {**GPTQ, "desc_act": True}, True)
    weights = load_file(qdir / "model.safetensors")
    key = "model.layers.0.self_attn.k_proj.g_idx"
    weights[key] = weights[key].flip(0).contiguous()
    save_file(weights, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match="differs between the fused shards"):
        LLM(str(qdir), num_blocks=16)


def test_a_missing_shard_is_named(tiny_src, tmp_path):
    qdir, _ = quantize_checkpoint(tiny_src, tmp_path / "gptq", GPTQ)
    weights = load_file(qdir / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.scales"]  # q and v keep theirs
    save_file(weights, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights, e.g. \['layers.1.self_attn.qkv_proj.scales'\]"):
        LLM(str(qdir), num_blocks=16)


def _with_config(src, tmp_path):
    path = tmp_path / "float-under-gptq"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": GPTQ}))
    return path


def test_dummy_weights_for_a_quantized_shape(tiny_src, tmp_path):
    path = tmp_path / "dummy"
    path.mkdir()
    config = json.loads((tiny_src / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": AWQ}))
    out, llm = _greedy(path, load_format="dummy")
    assert all(len(tokens) == 6 for tokens in out)
    # The random fill reached the packed integers, and g_idx kept its order.
    layer = llm.engine.runner.model.layers[0].mlp.down_proj
    assert (layer.qweight != 0).float().mean() > 0.9
    assert layer.g_idx.tolist() == [k // 32 for k in range(128)]


def test_tandem_quantize_writes_a_loadable_directory(tiny_src, tmp_path, capsys):
    from tandem.cli import main

    out = tmp_path / "awq"
    assert main(["quantize", str(out), "--model", str(tiny_src), "--method", "awq",
                 "--group-size", "32"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"
    weights = load_file(out / "model.safetensors")
    assert weights["model.layers.0.mlp.down_proj.qweight"].dtype == torch.int32
    assert "model.layers.0.mlp.down_proj.weight" not in weights
    assert weights["model.embed_tokens.weight"].is_floating_point()
    tokens, _ = _greedy(out)
    assert all(len(t) == 6 for t in tokens)
    # A second run would overwrite; 48 does not divide the 64 inputs; AWQ has no 8 bits.
    for argv, message in [
        ([str(out)], "already exists"),
        ([str(tmp_path / "b"), "--group-size", "48"], "not a multiple of group_size 48"),
        ([str(tmp_path / "c"), "--method", "awq", "--bits", "8"], "8-bit"),
    ]:
        assert main(["quantize", *argv, "--model", str(tiny_src)]) == 2
        assert message in capsys.readouterr().err
    # Quantizing a quantized model would keep its integers under a new config.
    assert main(["quantize", str(tmp_path / "d"), "--model", str(out)]) == 2
    assert "quantized already" in capsys.readouterr().err


def test_asking_for_a_quantization_checks_the_checkpoint(tiny_src, tmp_path):
    """vLLM's ``quantization=`` argument: optional here (the checkpoint says),
    but when given it must match."""
    qdir, _ = quantize_checkpoint(tiny_src, tmp_path / "awq", AWQ)
    tokens, _ = _greedy(qdir, quantization="awq")
    assert tokens == _greedy(qdir)[0]
    with pytest.raises(ValueError, match="quantization='gptq' was asked for, but .* is "
                                         "awq-quantized"):
        LLM(str(qdir), num_blocks=16, quantization="gptq")
    with pytest.raises(ValueError, match="is not quantized"):
        LLM(str(tiny_src), num_blocks=16, quantization="awq")
    with pytest.raises(ValueError, match="quantization must be one of gptq, awq"):
        LLM(str(qdir), num_blocks=16, quantization="bitsandbytes")

