"""Paged attention on the CPU that reads keys and values in place.

The torch reference (kernels/reference.py) gathers every sequence's blocks
into new padded float32 tensors each layer and then runs SDPA; on a decode
step that copying costs more than the attention itself. This C kernel walks
each sequence's block table instead: one work item per (kv head, tile of up
to 16 / group consecutive new tokens of a sequence; a decode is a tile of
one) scores the tile's query rows against the cached keys, loading each key
and value row once for all of them, in chunks with an online softmax
(running max and sum, float32 accumulation), so nothing is gathered and
nothing is padded. It serves decodes and prefills alike: query ``j`` of a
sequence with ``q_len`` new tokens sees keys ``[0, seq_len - q_len + j]``,
the reference's causal mask. ``store_kv`` writes the step's keys and values.

Same maths as the reference up to float32 rounding order (the softmax is
accumulated chunk by chunk rather than over the whole row at once); the
exponential is a polynomial of its own (within ~2 ulp of float32's).

The tiles' C source is in c_tiles.py (decodes with their sums in registers:
c_decode.py, or c_decode_avx2.py on CPUs with AVX2 but no AVX-512);
this module adds the dispatcher and the Python entry points.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from engine.attention import c_tiles, cbuild, paged_call
from engine.attention.c_prelude import VECTOR_MATH
from kernels import reference

_SOURCE = VECTOR_MATH + c_tiles.source() + r"""
/* Copy each token's key and value rows into its cache slot (-1: skip).
   Caches are contiguous: a slot is `row` elements, kv head h at h * head_dim. */
void store_kv(const char *key, int64_t ks0, int64_t ks1, const char *value, int64_t vs0,
              int64_t vs1, char *k_cache, char *v_cache, const int64_t *slots,
              int64_t num_tokens, int kv_heads, int head_dim, int esz)
{
    int64_t row = (int64_t)kv_heads * head_dim, bytes = (int64_t)head_dim * esz;
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        for (int h = 0; h < kv_heads; h++) {
            memcpy(k_cache + (slots[t] * row + h * head_dim) * esz, key + (t * ks0 + h * ks1) * esz, bytes);
            memcpy(v_cache + (slots[t] * row + h * head_dim) * esz, value + (t * vs0 + h * vs1) * esz, bytes);
        }
    }
}

/* Returns 0, or -1 when the shapes are outside what this kernel handles. */
int paged_attention(
    void *out, int64_t os0, int64_t os1,
    const void *query, int64_t qs0, int64_t qs1,
    const void *k_cache, const void *v_cache, int64_t cs0, int64_t cs1, int64_t cs2,
    const int32_t *block_tables, int64_t bts0,
    const int32_t *query_start_loc, const int32_t *seq_lens,
    int num_seqs, int num_tokens, int num_heads, int num_kv_heads, int head_dim,
    int block_size, float scale, int dtype, int max_query_len)
{
    int group = num_heads / num_kv_heads, nv = head_dim / W;
    if (head_dim % W || nv > MAX_VECS || group > MAX_ROWS || group * num_kv_heads != num_heads)
        return -1;
    /* Tiles of up to `tile` consecutive new tokens of one sequence. */
    int tile = MAX_ROWS / group;
    int64_t num_tiles = 0;
    /* Sequences with more new tokens than max_query_len are left to the caller. */
#define SERVED(s) (query_start_loc[(s) + 1] - query_start_loc[s] <= max_query_len)
    for (int s = 0; s < num_seqs; s++)
        if (SERVED(s)) num_tiles += (query_start_loc[s + 1] - query_start_loc[s] + tile - 1) / tile;
    int32_t *tiles = malloc(sizeof(int32_t) * 2 * (num_tiles > 0 ? num_tiles : 1));
    if (!tiles) return -1;
    int64_t k = 0;
    for (int s = 0; s < num_seqs; s++)
        for (int t = query_start_loc[s]; SERVED(s) && t < query_start_loc[s + 1]; t += tile) {
            tiles[2 * k] = s;
            tiles[2 * k + 1] = t;
            k++;
        }
    /* A work item is a tile and one kv head, or, for a batch of decodes
       (one new token per sequence) large enough to share out, a sequence
       and as many of its kv heads as MAX_ROWS query rows hold: one pass over
       its keys then reads whole cache rows (a token's heads are adjacent)
       and no two cores pull the same rows into their caches. Each query
       row's arithmetic is the same either way. */
    int all_decode = 1;
    for (int s = 0; all_decode && s < num_seqs; s++)
        all_decode = query_start_loc[s + 1] - query_start_loc[s] <= 1;
    /* Decodes of a specialised shape: one item per (sequence, kv head), its
       running sums in registers (c_decode.py; with AVX2 alone, any shape the
       tiles take, run by c_decode_avx2.py's tile_fast below); bf16 only with
       AVX512-BF16. */
    int fast_decode = 0;
#if HAVE_FAST_DECODE
    fast_decode = (dtype == F32 || HAVE_DPBF16) && all_decode && nv % 2 == 0
        && decode_shape(group, nv / 2);
#endif
    /* Every float32 tile, prompts too, where c_decode_avx2.py serves them. */
    int fast_tiles = 0;
#if HAVE_FAST_TILES
    fast_tiles = dtype == F32 && nv % 2 == 0 && decode_shape(group, nv / 2);
#endif
    int hk = 1;
    if (fast_decode && num_tiles >= 8 * omp_get_max_threads()) hk = num_kv_heads;
    if (all_decode && !fast_decode && num_tiles >= 8 * omp_get_max_threads())
        for (hk = num_kv_heads; hk > 1 && (hk * group > MAX_ROWS || num_kv_heads % hk); hk--) {}
    int64_t passes = num_kv_heads / hk, items = num_tiles * passes;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        int g = (int)(it % passes) * hk;
        int64_t tile_index = it / passes;
        int s = tiles[2 * tile_index], t0 = tiles[2 * tile_index + 1];
        int end = query_start_loc[s + 1], q_len = end - query_start_loc[s];
        int nt = end - t0 < tile ? end - t0 : tile;
        int ctx0 = seq_lens[s] - q_len + (t0 - query_start_loc[s]) + 1;
        const int32_t *table = block_tables + s * bts0;
#if HAVE_FAST_TILES
        if (fast_tiles) {
            for (int h = g; h < g + hk; h++)
                tile_fast(out, os0, os1, query, qs0, qs1, (const char *)k_cache,
                          (const char *)v_cache, cs0, cs1, cs2, table, t0, nt, ctx0, h, group,
                          nv / 2, block_size, scale);
            continue;
        }
#endif
#if HAVE_FAST_DECODE && !HAVE_FAST_TILES
        if (fast_decode) {
            for (int h = g; h < g + hk; h++)
            decode_fast(out, os0, os1, query, qs0, qs1, (const char *)k_cache,
                        (const char *)v_cache, cs0, cs1, cs2, table, t0, ctx0, h, group, nv / 2,
                        block_size, scale, dtype);
            continue;
        }
#endif
#define CALL(NV, DT) attend_tile(out, os0, os1, query, qs0, qs1, (const char *)k_cache, \
        (const char *)v_cache, cs0, cs1, cs2, table, t0, nt, ctx0, g, hk, group, NV, block_size, \
        scale, DT)
#define CALL_BF16(NP) attend_tile_bf16(out, os0, os1, query, qs0, qs1, (const char *)k_cache, \
        (const char *)v_cache, cs0, cs1, cs2, table, t0, nt, ctx0, g, hk, group, NP, block_size, \
        scale)
        if (dtype == BF16) {
#if HAVE_DPBF16
            if (nv == 4) CALL_BF16(2); else if (nv == 8) CALL_BF16(4);
            else if (nv % 2 == 0) CALL_BF16(nv / 2); else CALL(nv, BF16);
#else
            if (nv == 4) CALL(4, BF16); else if (nv == 8) CALL(8, BF16); else CALL(nv, BF16);
#endif
        } else {
            if (nv == 4) CALL(4, F32); else if (nv == 8) CALL(8, F32); else CALL(nv, F32);
        }
#undef CALL_BF16
#undef CALL
    }
    free(tiles);
    return 0;
}
"""

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _library():
    lib = cbuild.load("cpu_attention", _SOURCE)
    if lib is None:
        return None
    lib.store_kv.restype = None
    lib.store_kv.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64,
                             ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn = lib.paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [*paged_call.ARGTYPES, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the kernel is built and loadable on this machine."""
    return _library() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``paged_attention`` can serve these tensors (else use the reference)."""
    return (query.device.type == "cpu" and query.dtype in _DTYPES
            and k_cache.dtype == query.dtype and query.stride(-1) == 1
            and k_cache.stride(-1) == 1 and query.shape[-1] <= 256 and query.shape[-1] % 16 == 0
            and query.shape[1] % k_cache.shape[2] == 0 and query.shape[1] // k_cache.shape[2] <= 16
            and available())


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = do not store
) -> None:
    """``reference.store_kv`` into caches ``supports`` accepts, in one pass
    (the reference checks for skipped slots, then makes two index copies)."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv needs contiguous caches")
    if v_cache.dtype != k_cache.dtype or key.shape != value.shape:
        raise ValueError("caches must share a dtype, keys and values a shape")
    if key.dtype != k_cache.dtype or key.stride(-1) != 1:
        key = key.to(k_cache.dtype).contiguous()
    if value.dtype != k_cache.dtype or value.stride(-1) != 1:
        value = value.to(k_cache.dtype).contiguous()
    num_tokens, kv_heads, head_dim = key.shape
    if k_cache.shape[2:] != (kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches of shape {tuple(k_cache.shape)} cannot hold keys "
                         f"{tuple(key.shape)}")
    slots = slot_mapping.to(torch.int64).contiguous()
    _library().store_kv(
        key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0),
        value.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), num_tokens,
        kv_heads, head_dim, key.element_size(),
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int, on the host
    seq_lens: torch.Tensor,  # [num_seqs] int, on the host
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal paged attention of every sequence's new tokens (decodes are
    sequences with one), read straight from the cache. Check ``supports``
    first. The new tokens' keys and values must already be in the cache.
    Sequences with more than ``max_query_len`` new tokens are skipped: their
    rows of ``out`` are left as they were."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    paged_call.check_caches_and_out(query, k_cache, v_cache, out)
    tables, qsl, lens = paged_call.host_tables(block_tables, query_start_loc, seq_lens)
    rc = _library().paged_attention(
        *paged_call.leading_args(out, query, k_cache, v_cache, tables, qsl, lens),
        lens.shape[0], num_tokens, num_heads, num_kv_heads, head_dim, block_size, scale,
        _DTYPES[query.dtype], num_tokens if max_query_len is None else max_query_len,
    )
    if rc != 0:
        raise ValueError(f"unsupported attention shape: {num_heads} heads, {num_kv_heads} kv "
                         f"heads, head_dim {head_dim}")
    return out


def prefill_sdpa(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int, on the host
    seq_lens: torch.Tensor,  # [num_seqs] int, on the host
    scale: float,
    out: torch.Tensor,
    min_query_len: int,
) -> None:
    """Attention of the sequences with at least ``min_query_len`` new tokens,
    written to their rows of ``out``: each one's blocks gathered in the
    cache's dtype and one SDPA call (its CPU flash kernel runs the score and
    value products as matrix multiplies, which beats the kernel above on
    prompts of a few hundred tokens and more; below, the gather and the call
    per sequence cost more: torch_backend.SDPA_FROM). Query ``j`` sees keys
    up to its own position, as in ``reference.paged_prefill_attention``."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len < min_query_len:
            continue
        # [1, heads, tokens, dim]
        q = query[start:end].transpose(0, 1)[None]
        k = reference.gather_kv(k_cache, block_tables[i], seq_len).transpose(0, 1)[None]
        v = reference.gather_kv(v_cache, block_tables[i], seq_len).transpose(0, 1)[None]
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:  # new tokens after cached ones: the causal diagonal is offset
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
