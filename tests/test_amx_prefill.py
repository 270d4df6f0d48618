"""The AMX prefill kernel (engine/attention/amx_prefill.py; on CPUs without
AMX its tile steps run with AVX512-BF16 dot products) against
kernels.reference: whole prompts and chunks after cached tokens, lengths on
and off the 16-token tiles and 32-key steps, shuffled block tables whose
unused slots hold NaN, GQA groups 1/3/4 and head sizes 64/128,
blocks that do not hold whole 16-key tiles, and the torch backend's split
between it and the C kernel.

Tolerance 2e-2, as the C kernel's bfloat16 tests: P is rounded to bfloat16
before its product with V (the reference keeps float32), and the output to
bfloat16 once, so the two differ by about an ulp of the output.
"""

from __future__ import annotations

import pytest
import torch
from paged_fixtures import POISON, make_paged, randn

from engine.attention import amx_prefill
from kernels import reference

pytestmark = pytest.mark.skipif(not amx_prefill.available(),
                                reason="no AMX-BF16 / AVX512-BF16 on this CPU (or no compiler)")

BF16 = torch.bfloat16


def starts_of(query_lens):
    return torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)


def check(spec, heads, kv_heads, head_dim, block_size=16, min_query_len=1, seed=0):
    """spec: (cached, new) per sequence. Rows of sequences with fewer than
    ``min_query_len`` new tokens must be left as they were (NaN)."""
    lens = [c + q for c, q in spec]
    k_cache, v_cache, table, seq_lens = make_paged(lens, block_size, kv_heads, head_dim, BF16,
                                                   seed=seed)
    # NaN where no sequence owns a slot: a key past a sequence's end read
    # into a tile must be masked out, and 0 * NaN kept out of P V.
    for cache in (k_cache, v_cache):
        cache[cache == POISON] = float("nan")
    qsl = starts_of([q for _, q in spec])
    query = randn(int(qsl[-1]), heads, head_dim, dtype=BF16, seed=seed + 1)
    ref = reference.paged_prefill_attention(query, k_cache, v_cache, table, qsl, seq_lens, 0.11)
    out = torch.full_like(query, float("nan"))
    amx_prefill.prefill(query, k_cache, v_cache, table, qsl, seq_lens, 0.11, out, min_query_len)
    for i, (_, q) in enumerate(spec):
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        if q >= min_query_len:
            torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=2e-2, rtol=2e-2)
        else:
            assert out[rows].isnan().all()


# (cached, new): a prompt within one tile, prompts over tile and step
# boundaries, a chunk after cached blocks, one starting mid-block, a chunk
# of 2 (the backend's threshold), and one spanning several 32-key steps.
SPEC = [(0, 5), (0, 16), (0, 33), (16, 9), (13, 40), (45, 2), (100, 70)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64), (4, 4, 64), (16, 4, 64), (6, 2, 128), (8, 8, 128), (12, 3, 128),
])
def test_matches_reference(heads, kv_heads, head_dim):
    check(SPEC, heads, kv_heads, head_dim)


@pytest.mark.parametrize("block_size", [8, 32, 48])
def test_blocks_other_than_16(block_size):
    # 8 and 48: a 16-key tile spans blocks, so keys are copied, not read in place.
    check([(0, 40), (21, 35), (70, 100)], 9, 3, 64, block_size=block_size, seed=3)


def test_long_prompt_and_large_group():
    check([(0, 300), (250, 60)], 16, 1, 64, seed=5)


def test_short_sequences_are_left_to_the_caller():
    check([(0, 40), (5, 3), (20, 31), (0, 1)], 9, 3, 64, min_query_len=4, seed=7)


def test_strided_query_and_output_views():
    # The model hands in q as a view of the fused qkv projection.
    spec = [(0, 20), (7, 18)]
    lens = [c + q for c, q in spec]
    k_cache, v_cache, table, seq_lens = make_paged(lens, 16, 2, 64, BF16, seed=9)
    qsl = starts_of([q for _, q in spec])
    qkv = randn(38, 6 * 64 + 4 * 64, dtype=BF16, seed=10)
    query = qkv[:, : 6 * 64].view(38, 6, 64)
    wide = torch.full((38, 6, 128), float("nan"), dtype=BF16)
    out = wide[:, :, :64]
    amx_prefill.prefill(query, k_cache, v_cache, table, qsl, seq_lens, 0.125, out)
    ref = reference.paged_prefill_attention(query, k_cache, v_cache, table, qsl, seq_lens, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert wide[:, :, 64:].isnan().all()


def test_supports_only_what_it_computes():
    cache = torch.zeros(2, 16, 2, 64, dtype=BF16)
    assert amx_prefill.supports(torch.zeros(1, 4, 64, dtype=BF16), cache)
    assert not amx_prefill.supports(torch.zeros(1, 4, 64), cache.float())  # float32: SDPA's
    assert not amx_prefill.supports(torch.zeros(1, 4, 48, dtype=BF16),
                                    torch.zeros(2, 16, 2, 48, dtype=BF16))  # dim % 32
    assert not amx_prefill.supports(torch.zeros(1, 34, 64, dtype=BF16), cache)  # group 17
    assert not amx_prefill.supports(torch.zeros(1, 3, 64, dtype=BF16), cache)  # not a multiple
