"""The prefill tile kernels against kernels.reference: amx_prefill.py in
bfloat16 (on CPUs without AMX its products run as AVX512-BF16 dot products)
and f32_prefill.py in float32. Whole prompts and chunks after cached tokens,
lengths on and off the 16-token tiles and 32-key steps, shuffled block
tables whose unused slots hold NaN, GQA groups 1/3/4 and head sizes 64/128,
blocks that do not hold whole 16-key tiles, and strided views.

Tolerance in bfloat16 2e-2, as the C kernel's bfloat16 tests: P is rounded
to bfloat16 before its product with V (the reference keeps float32), and the
output to bfloat16 once, so the two differ by about an ulp of the output.
In float32 1e-5: only the order of the sums and the exponential differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from paged_fixtures import POISON, make_paged, randn

from engine.attention import amx_prefill, f32_prefill
from kernels import reference


@dataclass(frozen=True)
class Kernel:
    module: object
    dtype: torch.dtype
    tol: float


KERNELS = [
    pytest.param(Kernel(amx_prefill, torch.bfloat16, 2e-2), id="amx_prefill-bf16",
                 marks=pytest.mark.skipif(not amx_prefill.available(),
                                          reason="no AMX-BF16 / AVX512-BF16 (or no compiler)")),
    pytest.param(Kernel(f32_prefill, torch.float32, 1e-5), id="f32_prefill-fp32",
                 marks=pytest.mark.skipif(not f32_prefill.available(),
                                          reason="no AVX-512 (or no compiler)")),
]


@pytest.fixture(params=KERNELS)
def kernel(request) -> Kernel:
    return request.param


def starts_of(query_lens):
    return torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)


def check(kernel, spec, heads, kv_heads, head_dim, block_size=16, min_query_len=1, seed=0):
    """spec: (cached, new) per sequence. Rows of sequences with fewer than
    ``min_query_len`` new tokens must be left as they were (NaN)."""
    lens = [c + q for c, q in spec]
    k_cache, v_cache, table, seq_lens = make_paged(lens, block_size, kv_heads, head_dim,
                                                   kernel.dtype, seed=seed)
    # NaN where no sequence owns a slot: a key past a sequence's end read
    # into a tile must be masked out, and 0 * NaN kept out of P V.
    for cache in (k_cache, v_cache):
        cache[cache == POISON] = float("nan")
    qsl = starts_of([q for _, q in spec])
    query = randn(int(qsl[-1]), heads, head_dim, dtype=kernel.dtype, seed=seed + 1)
    ref = reference.paged_prefill_attention(query, k_cache, v_cache, table, qsl, seq_lens, 0.11)
    out = torch.full_like(query, float("nan"))
    kernel.module.prefill(query, k_cache, v_cache, table, qsl, seq_lens, 0.11, out, min_query_len)
    for i, (_, q) in enumerate(spec):
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        if q >= min_query_len:
            torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=kernel.tol,
                                       rtol=kernel.tol)
        else:
            assert out[rows].isnan().all()


# (cached, new): a prompt within one tile, prompts over tile and step
# boundaries, a chunk after cached blocks, one starting mid-block, a chunk
# of 2 (the backend's threshold), and one spanning several 32-key steps.
SPEC = [(0, 5), (0, 16), (0, 33), (16, 9), (13, 40), (45, 2), (100, 70)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64), (4, 4, 64), (16, 4, 64), (6, 2, 128), (8, 8, 128), (12, 3, 128),
])
def test_matches_reference(kernel, heads, kv_heads, head_dim):
    check(kernel, SPEC, heads, kv_heads, head_dim)


@pytest.mark.parametrize("block_size", [8, 32, 48])
def test_blocks_other_than_16(kernel, block_size):
    # 8 and 48: a 16-key tile spans blocks (amx_prefill copies its keys, f32_prefill reads rows).
    check(kernel, [(0, 40), (21, 35), (70, 100)], 9, 3, 64, block_size=block_size, seed=3)


def test_long_prompt_and_large_group(kernel):
    check(kernel, [(0, 300), (250, 60)], 16, 1, 64, seed=5)


def test_short_sequences_are_left_to_the_caller(kernel):
    check(kernel, [(0, 40), (5, 3), (20, 31), (0, 1)], 9, 3, 64, min_query_len=4, seed=7)


def test_strided_query_and_output_views(kernel):
    # The model hands in q as a view of the fused qkv projection.
    spec = [(0, 20), (7, 18)]
    lens = [c + q for c, q in spec]
    k_cache, v_cache, table, seq_lens = make_paged(lens, 16, 2, 64, kernel.dtype, seed=9)
    qsl = starts_of([q for _, q in spec])
    qkv = randn(38, 6 * 64 + 4 * 64, dtype=kernel.dtype, seed=10)
    query = qkv[:, : 6 * 64].view(38, 6, 64)
    wide = torch.full((38, 6, 128), float("nan"), dtype=kernel.dtype)
    out = wide[:, :, :64]
    kernel.module.prefill(query, k_cache, v_cache, table, qsl, seq_lens, 0.125, out)
    ref = reference.paged_prefill_attention(query, k_cache, v_cache, table, qsl, seq_lens, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=kernel.tol, rtol=kernel.tol)
    assert wide[:, :, 64:].isnan().all()


def test_supports_only_what_it_computes(kernel):
    dt, other = kernel.dtype, torch.float32 if kernel.dtype == torch.bfloat16 else torch.bfloat16
    cache = torch.zeros(2, 16, 2, 64, dtype=dt)
    supports = kernel.module.supports
    assert supports(torch.zeros(1, 4, 64, dtype=dt), cache)
    assert not supports(torch.zeros(1, 4, 64, dtype=other), cache.to(other))  # the other kernel's
    assert not supports(torch.zeros(1, 4, 48, dtype=dt), torch.zeros(2, 16, 2, 48, dtype=dt))  # dim % 32
    assert not supports(torch.zeros(1, 34, 64, dtype=dt), cache)  # group 17
    assert not supports(torch.zeros(1, 3, 64, dtype=dt), cache)  # not a multiple
