"""The CPU kernels of engine/layers/cpu_ops.py against kernels.reference and
torch, in bfloat16 and float32: rotary bit for bit, RMSNorm and SiLU-and-mul
within one bfloat16 ulp or a few float32 ones (their float32 sum order and exp
are their own), and the layers that pick them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import cpu_ops
from engine.layers.activation import silu_and_mul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from kernels import reference

pytestmark = pytest.mark.skipif(not cpu_ops.supports(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="no C compiler: the layers keep the reference ops")


DTYPES = [torch.bfloat16, torch.float32]


def randn(*shape, seed, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def assert_within_an_ulp(out, ref):
    if out.dtype == torch.float32:  # a few ulps where the sum order or exp differ
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        return
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-6, rtol=2**-7)
    assert (out != ref).float().mean() < 0.01  # and almost all bit-identical


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(rows, with_residual, dtype):
    x = randn(rows, 576, seed=1, scale=3.0, dtype=dtype)
    residual = randn(rows, 576, seed=2, dtype=dtype) if with_residual else None
    weight = randn(576, seed=3, dtype=dtype)
    out, res = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_res = reference.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(res, ref_res)
    assert_within_an_ulp(out, ref_out)
    # The layer picks the kernel for CPU rows.
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data.copy_(weight)
    with torch.inference_mode():
        layer_out, _ = norm(x, residual)
    assert torch.equal(layer_out, out)


def test_the_residual_add_rounds_every_bfloat16_as_torch():
    """Ties, subnormals (which a CPU's one-instruction conversion reads as
    zero), infinities and NaNs: the summed residual equals torch's bits."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).reshape(-1, 512)  # every bfloat16 value
    # Sums that land halfway between two bfloat16 values, and subnormal ones.
    other = torch.full_like(x, 2.0**-9).to(torch.bfloat16)
    other[::2] = torch.tensor(1e-39).to(torch.bfloat16)
    weight = torch.ones(512, dtype=torch.bfloat16)
    _, res = cpu_ops.rms_norm(x, weight, 1e-5, other)
    want = (x.float() + other.float()).to(torch.bfloat16)
    same = (res.view(torch.int16) == want.view(torch.int16)) | (res.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} sums rounded apart from torch"
    assert torch.equal(res.isnan(), want.isnan())
    _, copied = cpu_ops.rms_norm(x, weight, 1e-5)  # no residual: x itself, bit for bit
    assert torch.equal(copied.view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rotary_in_place_is_bit_identical(tokens, dtype):
    rope = RotaryEmbedding(64, 4096, 1e5, None)
    qkv = randn(tokens, (9 + 2 * 3) * 64, seed=4, dtype=dtype)  # q and k are views, as in the model
    q, k = qkv[:, : 9 * 64].view(tokens, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(tokens, 3, 64)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(5))
    cos, sin = rope.cos[positions], rope.sin[positions]
    ref_q, ref_k = reference.apply_rotary(q, cos, sin), reference.apply_rotary(k, cos, sin)
    v_before = qkv[:, 12 * 64 :].clone()
    out_q, out_k = rope(positions, q, k)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(qkv[:, 12 * 64 :], v_before)  # the values beside them untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inner", [(1, 1536), (64, 1536), (3, 40)])
def test_silu_and_mul_matches_torch(rows, inner, dtype):
    x = randn(rows, 2 * inner, seed=6, scale=4.0, dtype=dtype)
    x[0, :8] = torch.tensor([-100.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0])
    ref = F.silu(x[:, :inner]) * x[:, inner:]
    assert_within_an_ulp(cpu_ops.silu_and_mul(x), ref)
    assert_within_an_ulp(silu_and_mul(x), ref)


def test_other_dtypes_keep_the_reference_ops():
    assert not cpu_ops.supports(torch.zeros(2, 8, dtype=torch.float16))
    x = torch.randn(4, 16, dtype=torch.float16)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :8]) * x[:, 8:], rtol=0, atol=0)


@pytest.mark.parametrize("cols", [1, 5, 16, 17, 49152, 49157])
def test_argmax_equals_torch_on_the_widened_rows(cols):
    x = randn(37, cols, seed=7, scale=3.0)
    x[3, :] = x[3, 0]  # all tied: the first index
    if cols > 10:
        x[5, 7] = x[5, 9] = float("nan")  # a NaN is the largest, its first index
        x[6, :] = float("-inf")
        x[7, cols - 1] = 100.0  # the last column, past the 16-wide part
    assert torch.equal(cpu_ops.argmax(x), x.float().argmax(-1))
    assert torch.equal(cpu_ops.argmax(x[:, : cols // 2 + 1]), x[:, : cols // 2 + 1].float().argmax(-1))
