"""The CPU attention kernel (engine/attention/cpu_attention.py) against
kernels.reference: decodes, prefills, extends over cached tokens, and a
mixed batch through the torch backend, on shuffled block tables whose unused
slots hold a poison value.

Tolerances: float32 1e-5 (only the order of float32 sums differs); bfloat16
2e-2 (both round the same float32 result to bfloat16, so outputs differ by
at most an ulp where that order tips a rounding).
"""

from __future__ import annotations

import pytest
import torch
from paged_fixtures import make_paged, randn

from engine.attention import c_decode, cpu_attention
from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from kernels import reference

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="no C compiler: the kernel falls back to torch ops")

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = TOL[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def starts_of(query_lens):
    return torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)


# Lengths around the 16-token block boundary, one within a single token, and
# one longer than the kernel's 32-key softmax chunk; and a batch large enough
# to share out by sequence (several kv heads per pass over a sequence's keys).
FEW = [1, 15, 16, 17, 32, 33, 70]
MANY = [1 + (i * 37) % 150 for i in range(48)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,lens", [
    (9, 3, 64, FEW), (4, 4, 128, FEW), (8, 1, 32, FEW),
    (9, 3, 64, MANY), (32, 8, 64, MANY), (16, 2, 128, MANY), (6, 6, 32, MANY),
    # AVX2's decode: 7 query rows (register blocks of 6 and 1), 96-wide heads.
    (14, 2, 64, MANY), (6, 2, 96, FEW),
])
def test_decode_matches_reference(dtype, heads, kv_heads, head_dim, lens):
    k_cache, v_cache, table, seq_lens = make_paged(lens, 16, kv_heads, head_dim, dtype)
    query = randn(len(lens), heads, head_dim, dtype=dtype, seed=1)
    ref = reference.paged_decode_attention(query, k_cache, v_cache, table, seq_lens, 0.125)
    out = cpu_attention.paged_attention(query, k_cache, v_cache, table,
                                        starts_of([1] * len(lens)), seq_lens, 0.125)
    assert_close(out, ref)


@pytest.mark.parametrize("group,np_", c_decode.DECODE_SHAPES + [(7, 2), (4, 4)])
def test_every_specialised_bf16_decode_shape_matches_reference(group, np_):
    # bf16 decodes of these (query heads per kv head, 32-element vectors per
    # head) take the register-accumulator kernel where the CPU has
    # AVX512-BF16; the last two are outside the list (the tile kernel).
    lens = FEW + [150]
    k_cache, v_cache, table, seq_lens = make_paged(lens, 16, 2, 32 * np_, torch.bfloat16)
    query = randn(len(lens), 2 * group, 32 * np_, dtype=torch.bfloat16, seed=group)
    ref = reference.paged_decode_attention(query, k_cache, v_cache, table, seq_lens, 0.125)
    out = cpu_attention.paged_attention(query, k_cache, v_cache, table,
                                        starts_of([1] * len(lens)), seq_lens, 0.125)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_prefill_and_extend_match_reference(dtype):
    # (cached, new): whole prompts, a chunk over cached blocks, one over a boundary.
    spec = [(0, 5), (0, 16), (16, 9), (13, 40)]
    lens = [c + q for c, q in spec]
    k_cache, v_cache, table, seq_lens = make_paged(lens, 16, 2, 64, dtype)
    qsl = starts_of([q for _, q in spec])
    query = randn(int(qsl[-1]), 6, 64, dtype=dtype, seed=2)
    ref = reference.paged_prefill_attention(query, k_cache, v_cache, table, qsl, seq_lens, 0.1)
    out = cpu_attention.paged_attention(query, k_cache, v_cache, table, qsl, seq_lens, 0.1)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_long_prefills_by_sdpa_match_reference(dtype):
    # (cached, new): a whole prompt, a chunk after cached blocks, and one too
    # short for SDPA, whose rows must be left alone.
    spec = [(0, 40), (13, 35), (5, 3)]
    lens = [c + q for c, q in spec]
    k_cache, v_cache, table, seq_lens = make_paged(lens, 16, 3, 64, dtype)
    qsl = starts_of([q for _, q in spec])
    query = randn(int(qsl[-1]), 9, 64, dtype=dtype, seed=4)
    ref = reference.paged_prefill_attention(query, k_cache, v_cache, table, qsl, seq_lens, 0.1)
    out = torch.full_like(query, float("nan"))
    cpu_attention.prefill_sdpa(query, k_cache, v_cache, table, qsl, seq_lens, 0.1, out, 32)
    assert_close(out[:75], ref[:75])
    assert out[75:].isnan().all()
    # ...and the C kernel leaves the long ones to it.
    out = torch.full_like(query, float("nan"))
    cpu_attention.paged_attention(query, k_cache, v_cache, table, qsl, seq_lens, 0.1, out=out,
                                  max_query_len=31)
    assert out[:75].isnan().all()
    assert_close(out[75:], ref[75:])


def test_strided_query_and_preallocated_out():
    # The model hands in q as a view of the fused qkv projection.
    lens = [3, 20]
    k_cache, v_cache, table, seq_lens = make_paged(lens, 8, 1, 64, torch.float32)
    qkv = randn(2, 4 * 64 + 2 * 64, dtype=torch.float32, seed=3)
    query = qkv[:, : 4 * 64].view(2, 4, 64)
    out = torch.full((2, 4, 64), float("nan"))
    cpu_attention.paged_attention(query, k_cache, v_cache, table, starts_of([1, 1]), seq_lens,
                                  0.125, out=out)
    ref = reference.paged_decode_attention(query, k_cache, v_cache, table, seq_lens, 0.125)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_backend_mixed_batch_matches_reference_backend(dtype):
    # Two decodes, then prompts and extends in one step, short ones (the C
    # kernel) and long ones (a prefill tile kernel where the CPU has one for
    # the dtype, else SDPA over gathered blocks); the backend stores every
    # new token before attending.
    block_size, kv_heads, group, head_dim = 16, 3, 3, 64
    spec = [(16, 1), (40, 1), (0, 17), (15, 6), (0, 33), (20, 40)]  # (cached, new)
    lens = [c + q for c, q in spec]
    k_cache, v_cache, table, seq_lens = make_paged(lens, block_size, kv_heads, head_dim, dtype)
    slots = [int(table[i, pos // block_size]) * block_size + pos % block_size
             for i, (c, q) in enumerate(spec) for pos in range(c, c + q)]
    qsl = starts_of([q for _, q in spec])
    n = int(qsl[-1])
    query = randn(n, kv_heads * group, head_dim, dtype=dtype, seed=5)
    key = randn(n, kv_heads, head_dim, dtype=dtype, seed=6)
    value = randn(n, kv_heads, head_dim, dtype=dtype, seed=7)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=qsl, seq_lens=seq_lens,
        block_tables=table, query_start_loc_cpu=qsl.clone(), seq_lens_cpu=seq_lens.clone(),
        num_decode_seqs=2, max_query_len=40, max_seq_len=max(lens),
    )
    outs, caches = [], []
    for native in (True, False):
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(TorchAttentionBackend(native).forward(query, key, value, kc, vc, meta, 0.125))
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert_close(outs[0], outs[1])


def test_supports_only_what_it_computes():
    cache = torch.zeros(2, 16, 2, 64)
    assert cpu_attention.supports(torch.zeros(1, 4, 64), cache)
    assert not cpu_attention.supports(torch.zeros(1, 4, 64, dtype=torch.float16),
                                      cache.half())  # float16: the reference serves it
    assert not cpu_attention.supports(torch.zeros(1, 4, 64), cache.bfloat16())  # mixed dtypes
    assert not cpu_attention.supports(torch.zeros(1, 3, 64), cache)  # heads not a multiple
    assert not cpu_attention.supports(torch.zeros(1, 4, 40), torch.zeros(2, 16, 2, 40))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_store_kv_matches_reference(dtype):
    k_cache, v_cache = randn(6, 4, 2, 64, dtype=dtype, seed=0), randn(6, 4, 2, 64, dtype=dtype, seed=1)
    kv = randn(7, 3, 2, 64, dtype=dtype, seed=2)
    key, value = kv[:, 0], kv[:, 2]  # strided views, as the model's fused projection gives
    slots = torch.tensor([13, 2, -1, 23, 0, -1, 4])
    rk, rv = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, rk, rv, slots)
    cpu_attention.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, rk) and torch.equal(v_cache, rv)
    cpu_attention.store_kv(key.float(), value.float(), k_cache, v_cache, slots)  # converts
    assert torch.equal(k_cache, rk) and torch.equal(v_cache, rv)


def test_kernel_library_is_built_once_and_absent_without_a_compiler(monkeypatch, tmp_path):
    from engine.attention import cbuild

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    lib = cbuild.load("probe", "int probe(void) { return 42; }")
    assert lib is not None and lib.probe() == 42
    (built,) = (tmp_path / "kernels").glob("probe-*.so")
    mtime = built.stat().st_mtime_ns
    assert cbuild.load("probe", "int probe(void) { return 42; }").probe() == 42
    assert built.stat().st_mtime_ns == mtime  # cached, not rebuilt
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cbuild.load("probe2", "int probe(void) { return 1; }") is None
