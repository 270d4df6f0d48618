"""bfloat16 CPU matmuls through a prepacked weight (engine/layers/packed.py)
give ``F.linear``'s outputs (exactly through oneDNN's packing, within one
bfloat16 rounding through the AMX kernel), and follow the weight when it
changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import amx_linear
from engine.layers.packed import Linear, PackedWeight

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


def randn(*shape, seed, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_same_as_f_linear(out, x, weight, bias=None):
    ref = F.linear(x, weight, bias)
    if amx_linear.available() and amx_linear.fits(weight):
        # Float32 sums in another order: a bfloat16 result may round the other way.
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-5)
        assert (out != ref).float().mean() < 0.01
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    layer = Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = randn(rows, 96, seed=rows)
    with torch.inference_mode():
        out = layer(x)
    assert_same_as_f_linear(out, x, layer.weight, layer.bias)


def test_repacks_when_the_weight_is_written_or_replaced():
    packed, weight = PackedWeight(), randn(32, 64, seed=1)
    x = randn(4, 64, seed=2)
    with torch.inference_mode():
        assert_same_as_f_linear(packed.linear(x, weight), x, weight)
    weight.copy_(randn(32, 64, seed=3))  # in place: same storage, new version
    other = randn(32, 64, seed=4)
    with torch.inference_mode():
        assert_same_as_f_linear(packed.linear(x, weight), x, weight)
        assert_same_as_f_linear(packed.linear(x, other), x, other)
        made_here = randn(32, 64, seed=5)  # an inference tensor: F.linear
        assert torch.equal(packed.linear(x, made_here), F.linear(x, made_here))


def test_other_dtypes_and_autograd_keep_f_linear():
    layer = Linear(16, 8)
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).sum().backward()  # float32 with gradients: plain F.linear
    assert x.grad is not None
    bf = Linear(16, 8).to(torch.bfloat16)
    y = torch.randn(2, 3, 16).to(torch.bfloat16)  # leading dims are kept
    with torch.inference_mode():
        assert torch.equal(bf(y), F.linear(y, bf.weight, bf.bias))
