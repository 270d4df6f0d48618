"""The AMX decode matmul (engine/layers/amx_linear.py) against float32
matmuls of the same bfloat16 numbers: every row count up to MAX_ROWS (tile
padding), a bias, strided inputs, and shapes it must refuse."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import amx_linear

pytestmark = pytest.mark.skipif(not amx_linear.available(), reason="no AMX on this CPU")


def randn(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 64, 65, amx_linear.MAX_ROWS])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (1536, 48), (32, 16)])
def test_matches_a_float32_matmul_of_the_same_numbers(rows, in_features, out_features):
    x = randn(rows, in_features, seed=rows)
    weight = randn(out_features, in_features, seed=1, scale=0.05)
    bias = randn(out_features, seed=2)
    packed = amx_linear.pack(weight)
    for b in (None, bias):
        out = amx_linear.linear(x, packed, out_features, b)
        ref = F.linear(x.float(), weight.float(), None if b is None else b.float())
        assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
        # Float32 sums of exact bf16 products, then one rounding to bf16.
        torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=1e-4)
        assert torch.equal(out, ref.to(torch.bfloat16)) or (out != ref.to(torch.bfloat16)).float().mean() < 0.01


def test_strided_rows_are_read_in_place():
    wide = randn(20, 2 * 64, seed=3)
    x = wide[:, :64]  # every row 128 elements apart
    weight = randn(32, 64, seed=4)
    out = amx_linear.linear(x, amx_linear.pack(weight), 32)
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), rtol=2**-8, atol=1e-4)


def test_only_tile_shaped_bf16_weights_fit():
    assert amx_linear.fits(torch.zeros(16, 32, dtype=torch.bfloat16))
    assert not amx_linear.fits(torch.zeros(16, 48, dtype=torch.bfloat16))  # inputs not x32
    assert not amx_linear.fits(torch.zeros(24, 32, dtype=torch.bfloat16))  # outputs not x16
    assert not amx_linear.fits(torch.zeros(16, 32))  # float32
    with pytest.raises(ValueError, match="cannot multiply"):
        amx_linear.linear(randn(4, 48, seed=5), torch.zeros(16 * 48, dtype=torch.bfloat16), 16)
