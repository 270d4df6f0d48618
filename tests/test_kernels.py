"""Triton kernels against kernels.reference.

Without a GPU these run under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), which costs about a millisecond per program: the shapes
below keep every grid to tens of programs.

Tolerances (max over |out - ref| <= atol + rtol * |ref|): float32 1e-5;
float16 4e-3 (the kernels round softmax probabilities to float16 for the PV
matmul, as FlashAttention does); bfloat16 3e-2 (two bfloat16 roundings, and
the interpreter truncates float32 -> bfloat16 where torch rounds to nearest).
"""

from __future__ import annotations

import pytest
import torch
from paged_fixtures import make_paged, randn

from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from kernels import reference
from kernels.decode_attention import choose_num_splits, paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from kernels.rms_norm import rms_norm
from kernels.rotary import apply_rotary
from kernels.store_kv import store_kv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = TOL[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# --- store_kv -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_store_kv_matches_reference_and_skips_negative_slots(dtype):
    k_cache = randn(6, 4, 2, 64, dtype=dtype, seed=0)
    v_cache = randn(6, 4, 2, 64, dtype=dtype, seed=1)
    key = randn(7, 2, 64, dtype=dtype, seed=2)
    value = randn(7, 2, 64, dtype=dtype, seed=3)
    slots = torch.tensor([13, 2, -1, 23, 0, -1, 4], dtype=torch.int64)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_strided_input_and_dtype_conversion():
    # key/value as views into a fused qkv projection, float32 into a float16 cache.
    qkv = randn(5, 8, 16, dtype=torch.float32)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    k_cache = torch.zeros(3, 4, 2, 16, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 4, 5, 11, -1], dtype=torch.int32)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# --- decode -------------------------------------------------------------------

# 1, block_size - 1, block_size, block_size + 1 and several blocks (block_size 8).
DECODE_LENS = [1, 7, 8, 9, 29, 40]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_matches_reference(dtype, group, head_dim):
    num_kv_heads = 2
    k_cache, v_cache, table, seq_lens = make_paged(DECODE_LENS, 8, num_kv_heads, head_dim, dtype)
    query = randn(len(DECODE_LENS), num_kv_heads * group, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    ref = reference.paged_decode_attention(query, k_cache, v_cache, table, seq_lens, scale)
    # A 16-token tile spans two cache blocks.
    out = paged_decode_attention(
        query, k_cache, v_cache, table, seq_lens, scale, num_splits=1, block_n=16
    )
    assert out.dtype == dtype and out.shape == query.shape
    assert_close(out, ref)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_split_context(dtype, num_splits):
    # With 8 splits of 16-token tiles the short sequences leave splits empty.
    lens = [1, 5, 33, 70, 100]
    k_cache, v_cache, table, seq_lens = make_paged(lens, 4, 2, 64, dtype)
    query = randn(len(lens), 8, 64, dtype=dtype)
    ref = reference.paged_decode_attention(query, k_cache, v_cache, table, seq_lens, 0.125)
    out = paged_decode_attention(
        query, k_cache, v_cache, table, seq_lens, 0.125, num_splits=num_splits, block_n=16
    )
    assert_close(out, ref)


def test_decode_default_tiles_and_splits():
    lens = [300, 3, 17]
    k_cache, v_cache, table, seq_lens = make_paged(lens, 16, 1, 64, torch.float16)
    query = randn(len(lens), 4, 64, dtype=torch.float16)
    ref = reference.paged_decode_attention(query, k_cache, v_cache, table, seq_lens, 0.125)
    out = paged_decode_attention(query, k_cache, v_cache, table, seq_lens, 0.125)
    assert_close(out, ref)


def test_choose_num_splits():
    host = torch.device("cpu")  # 4 "SMs" on the host: a target of 8 programs
    assert choose_num_splits(8, 2, 4096, host) == 1  # enough programs already
    assert choose_num_splits(1, 1, 4096, host) == 8
    assert choose_num_splits(1, 1, 300, host) == 2  # never below 256 tokens a split
    assert choose_num_splits(1, 1, 1, host) == 1


def test_decode_strided_query_and_out_view():
    # The query is a view into a fused qkv tensor; the output goes into rows of a
    # larger buffer, as the backend does for the decode part of a mixed batch.
    lens = [9, 20]
    k_cache, v_cache, table, seq_lens = make_paged(lens, 4, 2, 64, torch.float32)
    qkv = randn(2, 12, 64, dtype=torch.float32)
    query = qkv[:, :8]
    ref = reference.paged_decode_attention(query, k_cache, v_cache, table, seq_lens, 0.125)
    buffer = torch.zeros(5, 8, 64)
    paged_decode_attention(
        query, k_cache, v_cache, table, seq_lens, 0.125, num_splits=2, out=buffer[:2], block_n=16
    )
    assert_close(buffer[:2], ref)
    assert torch.equal(buffer[2:], torch.zeros(3, 8, 64))


# --- prefill ------------------------------------------------------------------

# (cached tokens, new tokens): plain prefills, prefix-cache hits, a chunked
# extend across several tiles, a decode-like single token, an empty sequence.
PREFILL_SPEC = [(0, 1), (0, 7), (5, 3), (3, 0), (0, 9), (17, 20), (30, 1)]


def prefill_batch(spec, block_size, num_kv_heads, group, head_dim, dtype):
    lens = [c + q for c, q in spec]
    k_cache, v_cache, table, seq_lens = make_paged(lens, block_size, num_kv_heads, head_dim, dtype)
    starts = [0]
    for _, q in spec:
        starts.append(starts[-1] + q)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    query = randn(starts[-1], num_kv_heads * group, head_dim, dtype=dtype)
    return query, k_cache, v_cache, table, query_start_loc, seq_lens


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_prefill_matches_reference(dtype, group, head_dim):
    args = prefill_batch(PREFILL_SPEC, 4, 2, group, head_dim, dtype)
    query, k_cache, v_cache, table, qsl, seq_lens = args
    scale = head_dim**-0.5
    ref = reference.paged_prefill_attention(*args, scale)
    for block_m, block_n in [(None, None), (16, 16)]:
        out = paged_prefill_attention(
            query, k_cache, v_cache, table, qsl, seq_lens, scale, 20,
            block_m=block_m, block_n=block_n,
        )
        assert out.dtype == dtype
        assert_close(out, ref)


def test_prefill_long_chunk_many_tiles():
    # 70 new tokens after 45 cached, 16-row tiles: several query tiles, each with
    # unmasked key tiles before its causal stretch.
    args = prefill_batch([(45, 70), (0, 33)], 8, 1, 2, 64, torch.float32)
    query, k_cache, v_cache, table, qsl, seq_lens = args
    ref = reference.paged_prefill_attention(*args, 0.125)
    out = paged_prefill_attention(
        query, k_cache, v_cache, table, qsl, seq_lens, 0.125, block_m=16, block_n=16
    )
    assert_close(out, ref)


def test_prefill_subset_of_batch_with_offsets():
    # query_start_loc need not start at 0: the kernel touches only its sequences' rows.
    spec = [(0, 2), (6, 5), (0, 4)]
    query, k_cache, v_cache, table, qsl, seq_lens = prefill_batch(spec, 4, 2, 2, 64, torch.float16)
    ref = reference.paged_prefill_attention(
        query, k_cache, v_cache, table[1:], qsl[1:], seq_lens[1:], 0.125
    )
    out = torch.zeros_like(query)
    paged_prefill_attention(
        query, k_cache, v_cache, table[1:], qsl[1:], seq_lens[1:], 0.125, 5, out=out
    )
    assert_close(out[2:], ref[2:])
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))


def test_padded_group_and_head_dim():
    # SmolLM2's 3 query heads per kv head and a head_dim (80) that is not a power
    # of two: both are padded inside the kernels and masked.
    args = prefill_batch([(0, 6), (9, 4)], 4, 3, 3, 80, torch.float16)
    query, k_cache, v_cache, table, qsl, seq_lens = args
    ref = reference.paged_prefill_attention(*args, 0.1)
    out = paged_prefill_attention(query, k_cache, v_cache, table, qsl, seq_lens, 0.1, block_m=16)
    assert_close(out, ref)
    dec_query = query[qsl[1:] - 1]  # one token per sequence
    ref = reference.paged_decode_attention(dec_query, k_cache, v_cache, table, seq_lens, 0.1)
    for num_splits in (1, 2):
        out = paged_decode_attention(
            dec_query, k_cache, v_cache, table, seq_lens, 0.1, num_splits, block_n=16
        )
        assert_close(out, ref)


# --- the backend --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_triton_backend_matches_torch_backend(dtype):
    # Two decodes then two prefills; every new token is stored by the backend.
    block_size, num_kv_heads, group, head_dim = 4, 2, 4, 64
    spec = [(6, 1), (12, 1), (0, 5), (7, 6)]  # (cached, new)
    lens = [c + q for c, q in spec]
    k_cache, v_cache, table, seq_lens = make_paged(lens, block_size, num_kv_heads, head_dim, dtype)
    starts = [0]
    slots = []
    for i, (c, q) in enumerate(spec):
        starts.append(starts[-1] + q)
        for pos in range(c, c + q):
            slots.append(int(table[i, pos // block_size]) * block_size + pos % block_size)
    num_tokens = starts[-1]
    query = randn(num_tokens, num_kv_heads * group, head_dim, dtype=dtype, seed=5)
    key = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=6)
    value = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=7)
    qsl = torch.tensor(starts, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=table,
        query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=seq_lens.clone(),
        num_decode_seqs=2,
        max_query_len=6,
        max_seq_len=max(lens),
    )
    caches = {}
    outs = {}
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        kc, vc = k_cache.clone(), v_cache.clone()
        outs[backend.name] = backend.forward(query, key, value, kc, vc, meta, 0.125)
        caches[backend.name] = (kc, vc)
    assert TritonAttentionBackend.name == "triton"
    assert torch.equal(caches["triton"][0], caches["torch"][0])
    assert torch.equal(caches["triton"][1], caches["torch"][1])
    assert_close(outs["triton"], outs["torch"])


# --- rms norm and rotary ------------------------------------------------------


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_matches_reference(dtype, with_residual):
    x = randn(5, 96, dtype=dtype, seed=1)
    weight = randn(96, dtype=dtype, seed=2)
    residual = randn(5, 96, dtype=dtype, seed=3) if with_residual else None
    ref_out, ref_res = reference.rms_norm(x, weight, 1e-5, residual)
    out, res = rms_norm(x, weight, 1e-5, residual)
    assert out.dtype == ref_out.dtype
    assert_close(out, ref_out)
    assert_close(res, ref_res)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_apply_rotary_matches_reference(dtype):
    x = randn(6, 12, 3, 64, dtype=dtype)[:, :, 1]  # a strided view: [6, 12, 64]
    angles = torch.arange(6)[:, None] * torch.linspace(0.01, 1.0, 32)[None, :]
    cos, sin = angles.cos(), angles.sin()
    assert_close(apply_rotary(x, cos, sin), reference.apply_rotary(x, cos, sin))


# --- launcher errors ----------------------------------------------------------


def _decode_args(**overrides):
    k_cache, v_cache, table, seq_lens = make_paged([5, 9], 4, 2, 64, torch.float32)
    args = dict(
        query=randn(2, 4, 64, dtype=torch.float32), k_cache=k_cache, v_cache=v_cache,
        block_tables=table, seq_lens=seq_lens, scale=0.125,
    )
    return {**args, **overrides}


def _prefill_args(**overrides):
    query, k_cache, v_cache, table, qsl, seq_lens = prefill_batch(
        [(0, 3), (2, 2)], 4, 2, 2, 64, torch.float32
    )
    args = dict(
        query=query, k_cache=k_cache, v_cache=v_cache, block_tables=table,
        query_start_loc=qsl, seq_lens=seq_lens, scale=0.125,
    )
    return {**args, **overrides}


CACHE = torch.zeros(4, 4, 2, 64)
DECODE_ERRORS = {
    "query 2-d": dict(query=torch.zeros(2, 256)),
    "query dtype != cache dtype": dict(query=torch.zeros(2, 4, 64, dtype=torch.float16)),
    "heads not a multiple of kv heads": dict(query=torch.zeros(2, 3, 64)),
    "head_dim mismatch": dict(query=torch.zeros(2, 4, 32)),
    "query last dim strided": dict(query=torch.zeros(2, 4, 128)[:, :, ::2]),
    "cache not contiguous": dict(k_cache=torch.zeros(4, 2, 4, 64).transpose(1, 2)),
    "k/v cache shapes differ": dict(v_cache=torch.zeros(5, 4, 2, 64)),
    "k/v cache dtypes differ": dict(v_cache=CACHE.half()),
    "integer cache": dict(k_cache=CACHE.long(), v_cache=CACHE.long()),
    "float block table": dict(block_tables=torch.zeros(2, 3)),
    "block table rows": dict(block_tables=torch.zeros(3, 3, dtype=torch.int32)),
    "seq_lens length": dict(seq_lens=torch.ones(3, dtype=torch.int32)),
    "num_splits 0": dict(num_splits=0),
    "block_n not a power of two": dict(block_n=24),
    "out shape": dict(out=torch.zeros(2, 4, 32)),
}


@pytest.mark.parametrize("case", DECODE_ERRORS)
def test_decode_launcher_rejects_bad_input(case):
    with pytest.raises(ValueError):
        paged_decode_attention(**_decode_args(**DECODE_ERRORS[case]))


PREFILL_ERRORS = {
    "query_start_loc length": dict(query_start_loc=torch.tensor([0, 3], dtype=torch.int32)),
    "float query_start_loc": dict(query_start_loc=torch.tensor([0.0, 3.0, 5.0])),
    "seq_lens 2-d": dict(seq_lens=torch.ones(2, 1, dtype=torch.int32)),
    "block_m smaller than a group": dict(block_m=1),
    "negative max_query_len": dict(max_query_len=-1),
    "out dtype": dict(out=torch.zeros(5, 4, 64, dtype=torch.float16)),
}


@pytest.mark.parametrize("case", PREFILL_ERRORS)
def test_prefill_launcher_rejects_bad_input(case):
    with pytest.raises(ValueError):
        paged_prefill_attention(**_prefill_args(**PREFILL_ERRORS[case]))


def test_other_launchers_reject_bad_input():
    cache = torch.zeros(4, 4, 2, 64)
    key = torch.zeros(3, 2, 64)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="key"):
        store_kv(torch.zeros(3, 2, 32), key, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(2, 64), torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.zeros(2, 64), torch.ones(64), 1e-5, torch.zeros(2, 64).half())
    with pytest.raises(ValueError, match="cos"):
        apply_rotary(torch.zeros(2, 4, 64), torch.zeros(2, 16), torch.zeros(2, 32))
