"""The bfloat16 decode matmuls (engine/layers/amx_linear.py with AMX tiles,
engine/layers/avx512_linear.py with AVX512-BF16 dot products; both read the
same packed weight) against float32 matmuls of the same bfloat16 numbers:
every row count up to MAX_ROWS (tile padding, register blocks), output widths
that leave partial blocks, a bias, strided and misaligned inputs, and shapes
they must refuse. Each kernel runs where the CPU has its instructions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import amx_linear, avx512_linear


@pytest.fixture(params=[amx_linear, avx512_linear], ids=["amx", "avx512_bf16"])
def kernel(request):
    if not request.param.available():
        pytest.skip(f"{request.param.__name__} does not run on this CPU")
    return request.param


def randn(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def assert_one_rounding_from(out, ref):
    # Float32 sums of exact bf16 products, then one rounding to bf16.
    torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=1e-4)
    rounded = ref.to(torch.bfloat16)
    assert torch.equal(out, rounded) or (out != rounded).float().mean() < 0.01


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 15, 16, 17, 64, 65, 128, 145, 512])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (1536, 48), (32, 16), (64, 112)])
def test_matches_a_float32_matmul_of_the_same_numbers(kernel, rows, in_features, out_features):
    if rows > kernel.MAX_ROWS:
        pytest.skip(f"{kernel.__name__} serves at most {kernel.MAX_ROWS} rows")
    x = randn(rows, in_features, seed=rows)
    weight = randn(out_features, in_features, seed=1, scale=0.05)
    bias = randn(out_features, seed=2)
    packed = kernel.pack(weight)
    for b in (None, bias):
        out = kernel.linear(x, packed, out_features, b)
        assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
        assert_one_rounding_from(out, F.linear(x.float(), weight.float(),
                                               None if b is None else b.float()))


def test_strided_and_odd_offset_rows_are_read_in_place(kernel):
    wide = randn(20, 2 * 64 + 1, seed=3)
    weight = randn(32, 64, seed=4)
    for x in (wide[:, :64], wide[:, 1:65]):  # rows 129 elements apart; then an odd start
        out = kernel.linear(x, kernel.pack(weight), 32)
        assert_one_rounding_from(out, F.linear(x.float(), weight.float()))


def test_a_nan_stays_a_nan(kernel):
    x = randn(3, 32, seed=6)
    x[1, 5] = float("nan")
    out = kernel.linear(x, kernel.pack(randn(16, 32, seed=7)), 16)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


def test_only_tile_shaped_bf16_weights_fit():
    assert amx_linear.fits(torch.zeros(16, 32, dtype=torch.bfloat16))
    assert not amx_linear.fits(torch.zeros(16, 48, dtype=torch.bfloat16))  # inputs not x32
    assert not amx_linear.fits(torch.zeros(24, 32, dtype=torch.bfloat16))  # outputs not x16
    assert not amx_linear.fits(torch.zeros(16, 32))  # float32


def test_refuses_inputs_that_are_not_a_multiple_of_32(kernel):
    with pytest.raises(ValueError, match="cannot multiply"):
        kernel.linear(randn(4, 48, seed=5), torch.zeros(16 * 48, dtype=torch.bfloat16), 16)
