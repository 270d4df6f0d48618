"""float32 prefill attention with AVX-512, reading the paged cache in place.

The float32 counterpart of amx_prefill.py's flash-attention loop, for
prompts and chunks of many tokens, where SDPA over gathered blocks
(``cpu_attention.prefill_sdpa``) copies every block of the context per
layer and reaches ~130 GFLOPS on a 2-core AMD EPYC. A work item is a
sequence, a kv head and a tile of 16 new tokens, for all the query heads of
that kv head; it walks the sequence's keys 32 at a time up to the tile's
causal limit, reading key and value rows where they sit in the cache
blocks (no repacking: float32 needs no pairs). Per query head and step:
scores ``S^T = K Q^T`` with a lane per token (each key's element broadcast
against Q^T's row of that element, FMA), the online softmax of
c_flash_step.py in float32, and ``O += P V`` with P kept in float32 (each
token's weight broadcast against the value row). Query ``j`` of a sequence
with ``q_len`` new tokens sees keys ``[0, seq_len - q_len + j]``, as the
reference's causal mask.

Differs from the float32 reference (and SDPA) only by the order of the
float32 sums and by its exponential (~1e-7 relative).
"""

from __future__ import annotations

import torch

from engine.attention import c_amx_tiles, c_flash_step, paged_call

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
int f32_available(void) { return 1; }

#define ROWS 16      /* query tokens per work item */
#define KEYS 32      /* keys per step */
#define MAX_DIM 256
#define MAX_GROUP 16

""" + c_amx_tiles.HELPERS + "\n\n" + c_flash_step.SOFTMAX + "\n\n" + c_flash_step.WORK_ITEMS + r"""

/* Per-thread scratch, 64-byte aligned. */
typedef struct {
    float *qt;     /* [group][dim][ROWS]: Q^T of the work item, a lane per token */
    float *o;      /* [group][ROWS][dim] accumulators */
    float *m, *l;  /* [group][ROWS] running max (of scaled scores) and sum */
    float *st;     /* [KEYS][ROWS] scores S^T of one head and step */
    float *pt;     /* [KEYS][ROWS] its softmax weights P^T */
} scratch_t;

/* One query head's step over the keys whose rows are krow[0 .. n - 1] (and
   values vrow[0 .. n - 1]; krow past n points at a valid row, masked). */
static void step_head(scratch_t *sc, int h, int dim, const float **krow, const float **vrow,
                      int n, int seen0, float scale)
{
    const float *qt = sc->qt + (int64_t)h * dim * ROWS;
    /* S^T, 8 keys at a time: 8 independent chains of FMAs over the head's elements. */
    for (int m0 = 0; m0 < n; m0 += 8) {
        __m512 acc[8];
        for (int m = 0; m < 8; m++) acc[m] = _mm512_setzero_ps();
        for (int d = 0; d < dim; d++) {
            __m512 q = _mm512_load_ps(qt + d * ROWS);
            for (int m = 0; m < 8; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(krow[m0 + m][d]), q, acc[m]);
        }
        for (int m = 0; m < 8; m++) _mm512_store_ps(sc->st + (m0 + m) * ROWS, acc[m]);
    }
    float *o = sc->o + (int64_t)h * ROWS * dim;
    __m512 p[KEYS];
    online_softmax(sc->st, sc->m + h * ROWS, sc->l + h * ROWS, o, dim, n, seen0, scale, p);
    for (int i = 0; i < KEYS; i++) _mm512_store_ps(sc->pt + i * ROWS, p[i]);
    /* O += P V: 8 tokens x 32 elements of O in 16 accumulators at a time. */
    for (int r0 = 0; r0 < ROWS; r0 += 8)
        for (int c = 0; c < dim; c += 32) {
            __m512 acc[8][2];
            for (int r = 0; r < 8; r++)
                for (int j = 0; j < 2; j++) acc[r][j] = _mm512_load_ps(o + (r0 + r) * dim + c + j * 16);
            for (int i = 0; i < n; i++) {
                __m512 v0 = _mm512_loadu_ps(vrow[i] + c), v1 = _mm512_loadu_ps(vrow[i] + c + 16);
                for (int r = 0; r < 8; r++) {
                    __m512 b = _mm512_set1_ps(sc->pt[i * ROWS + r0 + r]);
                    acc[r][0] = _mm512_fmadd_ps(b, v0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(b, v1, acc[r][1]);
                }
            }
            for (int r = 0; r < 8; r++)
                for (int j = 0; j < 2; j++) _mm512_store_ps(o + (r0 + r) * dim + c + j * 16, acc[r][j]);
        }
}

/* Attention of every sequence with at least `min_query_len` new tokens;
   the others' rows of `out` are left as they were. Caches are
   [blocks, block_size, kv_heads, dim] with unit last stride. Returns 0, or
   -1 for shapes outside the kernel (dim % 32, dim > 256, group > 16) or
   when memory runs out. */
int f32_prefill(
    float *out, int64_t os0, int64_t os1, const float *query, int64_t qs0, int64_t qs1,
    const float *k_cache, const float *v_cache, int64_t cs0, int64_t cs1, int64_t cs2,
    const int32_t *block_tables, int64_t bts0, const int32_t *query_start_loc,
    const int32_t *seq_lens, int num_seqs, int num_heads, int num_kv_heads, int dim,
    int block_size, float scale, int min_query_len)
{
    int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    if (dim % 32 || dim > MAX_DIM || dim <= 0 || group < 1 || group > MAX_GROUP
        || group * num_kv_heads != num_heads || min_query_len < 1 || num_seqs < 0)
        return -1;
    int64_t num_items;
    item_t *items = work_items(query_start_loc, seq_lens, num_seqs, num_kv_heads, min_query_len,
                                &num_items);
    if (num_items <= 0) return (int)num_items;
    int failed = 0;
    #pragma omp parallel
    {
        scratch_t sc;
        int64_t rows = (int64_t)group * ROWS;
        sc.qt = zalloc(rows * dim * 4);
        sc.o = zalloc(rows * dim * 4);
        sc.m = zalloc(rows * 4);
        sc.l = zalloc(rows * 4);
        sc.st = zalloc(KEYS * ROWS * 4);
        sc.pt = zalloc(KEYS * ROWS * 4);
        int ok = sc.qt && sc.o && sc.m && sc.l && sc.st && sc.pt;
        if (!ok) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items; it++) {
            if (!ok) continue;
            const work_t w = work_item(items, it, query_start_loc, seq_lens, block_tables, bts0);
            const int g = w.g, t0 = w.t0, nt = w.nt, ctx0 = w.ctx0, ctx_end = w.ctx_end;
            const int32_t *table = w.table;
            /* Q^T of each head, 16 elements at a time (zero past the tile's tokens). */
            for (int h = 0; h < group; h++)
                for (int d0 = 0; d0 < dim; d0 += 16) {
                    __m512i x[16];
                    for (int r = 0; r < ROWS; r++)
                        x[r] = r < nt ? _mm512_loadu_si512(query + (t0 + r) * qs0 + (g * group + h) * qs1 + d0)
                                      : _mm512_setzero_si512();
                    transpose16(x);
                    float *dst = sc.qt + ((int64_t)h * dim + d0) * ROWS;
                    for (int i = 0; i < 16; i++) _mm512_store_si512(dst + i * ROWS, x[i]);
                }
            start_item(sc.o, sc.m, sc.l, rows, dim);
            for (int c0 = 0; c0 < ctx_end; c0 += KEYS) {
                int n = ctx_end - c0 < KEYS ? ctx_end - c0 : KEYS;
                const float *krow[KEYS], *vrow[KEYS];
                for (int i = 0; i < KEYS; i++) {
                    int pos = c0 + (i < n ? i : 0);
                    int64_t off = (int64_t)table[pos / block_size] * cs0 + (pos % block_size) * cs1 + g * cs2;
                    krow[i] = k_cache + off;
                    vrow[i] = v_cache + off;
                }
                for (int h = 0; h < group; h++)
                    step_head(&sc, h, dim, krow, vrow, n, ctx0 - c0, scale);
            }
            for (int h = 0; h < group; h++)
                for (int r = 0; r < nt; r++) {
                    const float *o = sc.o + ((int64_t)h * ROWS + r) * dim;
                    __m512 inv = _mm512_set1_ps(1.f / sc.l[h * ROWS + r]);
                    float *dst = out + (t0 + r) * os0 + (g * group + h) * os1;
                    for (int d = 0; d < dim; d += 16)
                        _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_load_ps(o + d), inv));
                }
        }
        free(sc.qt); free(sc.o); free(sc.m); free(sc.l); free(sc.st); free(sc.pt);
    }
    free(items);
    return failed ? -1 : 0;
}
#else
int f32_available(void) { return 0; }
int f32_prefill(void) { return -1; }
#endif
"""


_KERNEL = paged_call.TileKernel("f32_prefill", _SOURCE, torch.float32,
                              lambda lib: lib.f32_available() == 1)
available = _KERNEL.available
supports = _KERNEL.supports
prefill = _KERNEL.prefill
