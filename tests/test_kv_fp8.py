"""An 8-bit (fp8) KV cache: the reference maths, the Triton kernels against it
(under the interpreter here), and the backends end to end.

Attention over an fp8 cache must equal attention over the same cache widened
to float32 and multiplied by its scales: that is the whole definition, so the
reference is checked against it to float32 rounding, and the Triton kernels
against the reference with the float32 tolerance of tests/test_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from paged_fixtures import make_paged, randn

from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from kernels import reference
from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from kernels.store_kv import store_kv

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
K_SCALE, V_SCALE = 0.5, 2.0  # not 1.0, so a scale applied twice or never shows


def fp8_paged(lens, block_size, heads, head_dim, dtype):
    """make_paged's float32 caches stored as fp8 with (K_SCALE, V_SCALE), and
    the same caches widened back: what the fp8 cache means."""
    k, v, table, seq_lens = make_paged(lens, block_size, heads, head_dim, torch.float32)
    k8, v8 = reference.quantize_kv(k, dtype, K_SCALE), reference.quantize_kv(v, dtype, V_SCALE)
    k32, v32 = reference.dequantize_kv(k8, K_SCALE), reference.dequantize_kv(v8, V_SCALE)
    return (k8, v8), (k32, v32), table, seq_lens


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_quantize_clamps_instead_of_overflowing_and_round_trips_within_a_mantissa_step(dtype):
    x = torch.tensor([0.0, 1.0, -3.3, 1e6, -1e6, 0.017])
    q = reference.quantize_kv(x, dtype, 2.0)
    assert q.dtype == dtype
    back = reference.dequantize_kv(q, 2.0)
    limit = torch.finfo(dtype).max * 2.0
    assert torch.isfinite(back).all()
    assert back[3] == limit and back[4] == -limit
    mantissa_bits = 3 if dtype == torch.float8_e4m3fn else 2
    small = torch.tensor([0, 1, 2])  # 0.017 / 2 is subnormal in e4m3: coarser
    rel = ((back[small] - x[small]).abs() / x[small].abs().clamp_min(1e-6))
    assert float(rel.max()) <= 2.0 ** -(mantissa_bits + 1) + 1e-6


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_dequantize_is_exact_for_every_finite_byte(dtype):
    values = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = torch.isfinite(values.float())
    for scale in (1.0, 0.5):
        got = reference.dequantize_kv(values, scale)
        assert torch.equal(got[finite], values.float()[finite] * scale)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_reference_store_writes_quantized_bytes_and_skips_negative_slots(dtype):
    k_cache = torch.zeros(4, 4, 2, 16, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    key, value = randn(5, 2, 16, dtype=torch.bfloat16, seed=2), randn(5, 2, 16, dtype=torch.bfloat16)
    slots = torch.tensor([3, -1, 8, 15, 0])
    reference.store_kv(key, value, k_cache, v_cache, slots, K_SCALE, V_SCALE)
    flat_k = k_cache.view(16, 2, 16).view(torch.uint8)
    flat_v = v_cache.view(16, 2, 16).view(torch.uint8)
    keep = slots >= 0
    want_k = reference.quantize_kv(key[keep], dtype, K_SCALE).view(torch.uint8)
    want_v = reference.quantize_kv(value[keep], dtype, V_SCALE).view(torch.uint8)
    assert torch.equal(flat_k[slots[keep]], want_k) and torch.equal(flat_v[slots[keep]], want_v)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert int(flat_k[untouched].count_nonzero()) == 0


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_reference_attention_over_fp8_is_attention_over_the_widened_cache(dtype):
    lens = [1, 9, 30]
    (k8, v8), (k32, v32), table, seq_lens = fp8_paged(lens, 4, 2, 32, dtype)
    query = randn(len(lens), 6, 32, dtype=torch.float32)
    got = reference.paged_decode_attention(query, k8, v8, table, seq_lens, 0.2, K_SCALE, V_SCALE)
    want = reference.paged_decode_attention(query, k32, v32, table, seq_lens, 0.2)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    qsl = torch.tensor([0, 1, 4, 9], dtype=torch.int32)  # 1, 3 and 5 new tokens
    pq = randn(9, 6, 32, dtype=torch.float32, seed=3)
    got = reference.paged_prefill_attention(pq, k8, v8, table, qsl, seq_lens, 0.2,
                                            K_SCALE, V_SCALE)
    want = reference.paged_prefill_attention(pq, k32, v32, table, qsl, seq_lens, 0.2)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_triton_store_is_bit_exact_with_the_reference(dtype):
    k_cache = torch.zeros(6, 4, 2, 64, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    key = randn(7, 2, 64, dtype=torch.float32, seed=2) * 300  # some beyond e4m3's 448
    value = randn(7, 2, 64, dtype=torch.float32, seed=3)
    value[0, 0, :4] = torch.tensor([-1e-9, 1e-9, -0.0, 0.0])  # a negative rounds to -0 (0x80)
    slots = torch.tensor([13, 2, -1, 23, 0, -1, 4])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_ref, v_ref, slots, K_SCALE, V_SCALE)
    store_kv(key, value, k_cache, v_cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


@pytest.mark.parametrize("qdtype", [torch.float32, torch.float16], ids=["q32", "q16"])
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_triton_attention_over_fp8_matches_the_reference(dtype, qdtype):
    # SmolLM2-like: 3 query heads per kv head, head_dim 80 (padded in the kernels).
    lens = [1, 7, 40]
    (k8, v8), _, table, seq_lens = fp8_paged(lens, 4, 2, 80, dtype)
    tol = 1e-5 if qdtype == torch.float32 else 4e-3
    query = randn(len(lens), 6, 80, dtype=qdtype)
    ref = reference.paged_decode_attention(query, k8, v8, table, seq_lens, 0.1, K_SCALE, V_SCALE)
    for num_splits in (1, 2):
        out = paged_decode_attention(query, k8, v8, table, seq_lens, 0.1, num_splits,
                                     block_n=16, k_scale=K_SCALE, v_scale=V_SCALE)
        assert out.dtype == qdtype
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    qsl = torch.tensor([0, 1, 5, 11], dtype=torch.int32)
    pq = randn(11, 6, 80, dtype=qdtype, seed=4)
    ref = reference.paged_prefill_attention(pq, k8, v8, table, qsl, seq_lens, 0.1,
                                            K_SCALE, V_SCALE)
    out = paged_prefill_attention(pq, k8, v8, table, qsl, seq_lens, 0.1, 6, block_m=16,
                                  block_n=16, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_triton_launchers_refuse_a_query_of_another_dtype_than_a_float_cache():
    k, v, table, seq_lens = make_paged([3], 4, 1, 16, torch.float16)
    with pytest.raises(ValueError, match="query has dtype"):
        paged_decode_attention(randn(1, 1, 16, dtype=torch.float32), k, v, table, seq_lens, 0.1)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_backends_store_and_attend_alike_over_an_fp8_cache(dtype):
    # Two decodes and two prefills through each backend's forward, the
    # backends carrying the scales as the engine sets them.
    block_size, heads, group, head_dim = 4, 2, 2, 32
    spec = [(6, 1), (11, 1), (0, 5), (7, 4)]  # (cached, new)
    lens = [c + q for c, q in spec]
    (k8, v8), _, table, seq_lens = fp8_paged(lens, block_size, heads, head_dim, dtype)
    starts, slots = [0], []
    for i, (c, q) in enumerate(spec):
        starts.append(starts[-1] + q)
        slots += [int(table[i, p // block_size]) * block_size + p % block_size
                  for p in range(c, c + q)]
    n = starts[-1]
    query = randn(n, heads * group, head_dim, dtype=torch.float32, seed=5)
    key = randn(n, heads, head_dim, dtype=torch.float32, seed=6)
    value = randn(n, heads, head_dim, dtype=torch.float32, seed=7)
    qsl = torch.tensor(starts, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=qsl, seq_lens=seq_lens,
        block_tables=table, query_start_loc_cpu=qsl.clone(), seq_lens_cpu=seq_lens.clone(),
        num_decode_seqs=2, max_query_len=5, max_seq_len=max(lens),
    )
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        backend.k_scale, backend.v_scale = K_SCALE, V_SCALE
        kc, vc = k8.clone(), v8.clone()
        out = backend.forward(query, key, value, kc, vc, meta, 0.15)
        results.append((out, kc.view(torch.uint8), vc.view(torch.uint8)))
    (out_t, kt, vt), (out_tr, ktr, vtr) = results
    assert torch.equal(kt, ktr) and torch.equal(vt, vtr)
    torch.testing.assert_close(out_tr, out_t, atol=1e-5, rtol=1e-5)


def test_layout_carries_the_cache_dtype_and_scales_and_refuses_a_mismatch():
    import grpc

    from kv_transfer.layout import KVLayout
    from rpc.errors import LayoutMismatch, status_for

    base = dict(model_fingerprint="ab", dtype="bfloat16", block_size=16, num_layers=2,
                num_kv_heads=2, head_dim=64)
    plain = KVLayout(**base)
    fp8 = KVLayout(**base, kv_cache_dtype="fp8_e4m3", kv_scales=(0.5, 2.0))
    assert KVLayout.from_proto(fp8.to_proto()) == fp8
    assert KVLayout.from_proto(plain.to_proto()) == plain
    assert plain == KVLayout(**base, kv_cache_dtype="")  # "" is the model's dtype
    assert 2 * fp8.block_bytes_per_layer == plain.block_bytes_per_layer
    with pytest.raises(LayoutMismatch) as exc:
        fp8.check_compatible(plain, "decode worker d1")
    msg = str(exc.value)
    assert "kv_cache_dtype: this worker 'fp8_e4m3', decode worker d1 'bfloat16'" in msg
    assert "kv_scales: this worker (0.5, 2.0), decode worker d1 (1.0, 1.0)" in msg
    assert status_for(exc.value) == grpc.StatusCode.FAILED_PRECONDITION
