"""CPU matmuls through a prepacked weight (engine/layers/packed.py) give
``F.linear``'s outputs (bfloat16: exactly through oneDNN's packing, within one
bfloat16 rounding through the AMX or AVX512-BF16 decode kernel; float32:
through MKL's packed sgemm, oneDNN's or the FMA kernel, within float32
summation order), and follow the weight when it changes. Every float32 path
this CPU can run is tried here, whichever its vendor picks, and bfloat16 runs
with and without this CPU's decode kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import amx_linear, fma_linear_f32, packed
from engine.layers.packed import Linear, PackedWeight

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


@pytest.fixture(params=["mkl", "onednn", "fma"], autouse=True)
def fp32_library(request, monkeypatch):
    """Each test with float32 weights packed by MKL (Intel CPUs), by the FMA
    kernel (other CPUs with AVX-512 or AVX2) and by oneDNN (the rest)."""
    if request.param == "fma" and not fma_linear_f32.available():
        pytest.skip("neither AVX-512 nor AVX2 with FMA on this CPU")
    monkeypatch.setattr(packed, "FP32_MKL", request.param == "mkl")
    if request.param == "onednn":
        monkeypatch.setattr(packed, "_f32_kernel", lambda: None)
    return request.param


@pytest.fixture(params=["decode-kernel", "onednn"], autouse=True)
def bf16_library(request, monkeypatch):
    """Each test with bfloat16 weights in this CPU's decode kernel layout, and in oneDNN's."""
    if request.param == "decode-kernel" and packed._decode_kernel() is None:
        pytest.skip("no bfloat16 decode kernel runs on this CPU")
    if request.param == "onednn":
        monkeypatch.setattr(packed, "_decode_kernel", lambda: None)
    return request.param


def randn(*shape, seed, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_same_as_f_linear(out, x, weight, bias=None):
    ref = F.linear(x, weight, bias)
    if x.dtype == torch.float32:  # the sum may be blocked another way: last bits only
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    elif packed._decode_kernel() is not None and amx_linear.fits(weight):
        # Float32 sums in another order: a bfloat16 result may round the other way.
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-5)
        assert (out != ref).float().mean() < 0.01
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias, dtype):
    layer = Linear(96, 160, bias=bias).to(dtype)
    x = randn(rows, 96, seed=rows, dtype=dtype)
    with torch.inference_mode():
        out = layer(x)
    assert_same_as_f_linear(out, x, layer.weight, layer.bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_repacks_when_the_weight_is_written_or_replaced(dtype):
    packed, weight = PackedWeight(), randn(32, 64, seed=1, dtype=dtype)
    x = randn(4, 64, seed=2, dtype=dtype)
    with torch.inference_mode():
        assert_same_as_f_linear(packed.linear(x, weight), x, weight)
    weight.copy_(randn(32, 64, seed=3, dtype=dtype))  # in place: same storage, new version
    other = randn(32, 64, seed=4, dtype=dtype)
    with torch.inference_mode():
        assert_same_as_f_linear(packed.linear(x, weight), x, weight)
        assert_same_as_f_linear(packed.linear(x, other), x, other)
        made_here = randn(32, 64, seed=5, dtype=dtype)  # an inference tensor: F.linear
        assert torch.equal(packed.linear(x, made_here), F.linear(x, made_here))


def test_float32_is_packed_from_three_rows_by_mkl_from_one_otherwise(fp32_library):
    layer = Linear(64, 32)
    with torch.inference_mode():
        layer(torch.randn(2, 64))
        if fp32_library == "mkl":
            assert layer.packed._packed is None  # one or two rows: F.linear, nothing packed
        else:
            assert layer.packed._packed is not None
        layer(torch.randn(3, 64))
        assert layer.packed._packed is not None
    expected = fma_linear_f32 if fp32_library == "fma" else None
    assert layer.packed._kernel is expected


@pytest.mark.skipif(not fma_linear_f32.available(), reason="no AVX-512 or AVX2 on this CPU")
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 64, 129])
@pytest.mark.parametrize("out_features", [16, 48, 80, 576])  # 1, 3, 5, 36 groups of 16
def test_fma_f32_kernel_every_row_and_group_remainder(rows, out_features):
    # Row blocks of 6 with every remainder, and output groups that split into
    # 2-4 vectors per register block with a short last one; a strided x.
    weight = randn(out_features, 40, seed=out_features, dtype=torch.float32)
    bias = randn(out_features, seed=1, dtype=torch.float32)
    x = randn(rows, 56, seed=rows, dtype=torch.float32)[:, 8:48]
    out = fma_linear_f32.linear(x, fma_linear_f32.pack(weight), out_features, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_fma_f32_pack_refuses_what_it_cannot_lay_out():
    with pytest.raises(ValueError, match="multiple of 16"):
        fma_linear_f32.pack(torch.zeros(24, 8))
    with pytest.raises(ValueError, match="float32"):
        fma_linear_f32.pack(torch.zeros(32, 8, dtype=torch.bfloat16))


def test_other_dtypes_and_autograd_keep_f_linear():
    layer = Linear(16, 8)
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).sum().backward()  # float32 with gradients: plain F.linear
    assert x.grad is not None
    bf = Linear(16, 8).to(torch.bfloat16)
    y = torch.randn(2, 3, 16).to(torch.bfloat16)  # leading dims are kept
    with torch.inference_mode():
        assert torch.equal(bf(y), F.linear(y, bf.weight, bf.bias))


def test_bfloat16_keeps_f_linear_where_onednn_cannot_pack_it(monkeypatch):
    # An AVX2-only CPU: oneDNN refuses to reorder bf16 weights, so nothing is packed.
    monkeypatch.setattr(packed, "_onednn_bf16", lambda: False)
    layer = Linear(64, 32).to(torch.bfloat16)
    x = randn(5, 64, seed=6)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer.packed._packed is None
