"""bfloat16 prefill attention with AMX tiles, reading the paged cache in place.

SDPA over gathered blocks (``cpu_attention.prefill_sdpa``) runs prefill's
two products as matrix multiplies, but per sequence: it copies the blocks,
pays a call's overhead, and reaches ~80-110 GFLOPS here. This kernel is the
flash-attention loop on AMX: one work item is a sequence, a kv head and a
tile of 16 new tokens, for all the query heads of that kv head. It walks the
sequence's keys 32 at a time up to the tile's causal limit; each step
repacks the 32 keys (transposed into dimension pairs) and values (key pairs
interleaved) from their cache blocks into a small per-thread buffer, once
for the whole head group, then per query head: scores ``S = Q K^T`` in
float32 tiles, the online softmax in float32 (running max and sum per row),
``P`` rounded to bfloat16, and ``O += P V`` in float32 tiles. Query ``j`` of
a sequence with ``q_len`` new tokens sees keys ``[0, seq_len - q_len + j]``,
the reference's causal mask, so chunked prefills and prefix hits are served
as they are.

Where the CPU has AVX512-BF16 but no AMX, the step's two products run in
registers as ``vdpbf16ps`` with one operand broadcast from memory, on the
same layouts: on a 2-core AMD EPYC a layer of 8 x 500-token prefills takes
9.7 ms against 37 in cpu_attention's tile kernel and 41 in SDPA (1 x 2000
tokens: 15, 68, 41; ``benchmarks/prefill_attention_cpu.py``).
The C text is in three parts: the tile operations (c_amx_tiles.py), one
32-key step (c_flash_step.py) and the work items here.
Only where the CPU has AVX512-BF16 and the kernel builds (``available``).
Differs from the float32 reference by the bfloat16 rounding of ``P`` and of
the output, and by its exponential (~1e-6).
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
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AVX512BF16__)

""" + c_amx_tiles.TILE_OPS + r"""

#define ROWS 16      /* query tokens per work item (one tile's rows) */
#define KEYS 32      /* keys per step: two score tiles, one P tile's depth */
#define MAX_DIM 256
#define MAX_GROUP 16
#define PACK_AHEAD 4 /* query tiles from which a sequence's cache is packed once for all */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

""" + c_amx_tiles.HELPERS + r"""

""" + c_flash_step.WORK_ITEMS + r"""

/* Per-thread scratch, 64-byte aligned. Scores are kept transposed (a row
   per key, a lane per query token), so the softmax's running max and sum
   over keys are plain vector operations across rows. */
typedef struct {
    int32_t *qt;   /* [group][dim / 32][16 dim pairs][16 tokens]: Q^T tiles of the work item */
    float *o;      /* [group][ROWS][dim] float32 accumulators */
    float *m, *l;  /* [group][ROWS] running max (of scaled scores) and sum */
    int32_t *vp;   /* one step's values, for a sequence not packed ahead (see pack_step) */
    uint16_t *k;   /* and its keys, where they are not read in place */
    float *st;     /* [KEYS][ROWS] scores S^T of one head and step */
    int32_t *pt;   /* [ROWS][16 key pairs]: P (bf16 pairs) of one head and step */
} scratch_t;

""" + c_flash_step.SOURCE + r"""

/* Attention of every sequence with at least `min_query_len` new tokens;
   the others' rows of `out` are left as they were. Caches are
   [blocks, block_size, kv_heads, dim] with unit last stride. Returns 0, or
   -1 for shapes outside the kernel (dim % 32, dim > 256, group > 16) or
   when memory runs out. */
int amx_prefill(
    uint16_t *out, int64_t os0, int64_t os1, const uint16_t *query, int64_t qs0, int64_t qs1,
    const uint16_t *k_cache, const uint16_t *v_cache, int64_t cs0, int64_t cs1, int64_t cs2,
    const int32_t *block_tables, int64_t bts0, const int32_t *query_start_loc,
    const int32_t *seq_lens, int num_seqs, int num_heads, int num_kv_heads, int dim,
    int block_size, float scale, int min_query_len)
{
    int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    if (dim % 32 || dim > MAX_DIM || dim <= 0 || group < 1 || group > MAX_GROUP
        || group * num_kv_heads != num_heads || min_query_len < 1 || num_seqs < 0)
        return -1;
#define SERVED(s) (query_start_loc[(s) + 1] - query_start_loc[s] >= min_query_len)
#define TILES(s) ((query_start_loc[(s) + 1] - query_start_loc[s] + ROWS - 1) / ROWS)
    /* Work items, and the 32-key steps of the caches packed ahead. */
    int64_t num_items, num_steps = 0;
    item_t *items = work_items(query_start_loc, seq_lens, num_seqs, num_kv_heads, min_query_len,
                                &num_items);
    if (num_items <= 0) return (int)num_items;
    for (int s = 0; s < num_seqs; s++)
        if (SERVED(s) && TILES(s) >= PACK_AHEAD) num_steps += (seq_lens[s] + KEYS - 1) / KEYS;
    /* A sequence of PACK_AHEAD+ tiles has each step's values (and keys,
       where blocks do not hold whole 16-key tiles to read in place) packed
       once, before any tile reads them: step j, kv head g at
       (first[s] + j) * num_kv_heads + g. Shorter ones (first[s] = -1) pack
       each step as a tile reaches it, into a buffer that stays in L1. */
    const int in_place = block_size % 16 == 0;
    const int64_t v_step = (int64_t)(dim / 16) * 256, k_step = (int64_t)KEYS * dim;
    int64_t *first = malloc(sizeof(int64_t) * (num_seqs + 1));
    int32_t *step_seq = malloc(sizeof(int32_t) * (num_steps + 1));
    int32_t *vpack = aligned_alloc(64, (num_steps * num_kv_heads * v_step + 1) * 4);
    uint16_t *kpack = in_place ? NULL : aligned_alloc(64, (num_steps * num_kv_heads * k_step + 1) * 2);
    int failed = !first || !step_seq || !vpack || (!in_place && !kpack);
    if (failed) goto done;
    int64_t j = 0;
    for (int s = 0; s < num_seqs; s++) {
        first[s] = -1;
        if (!SERVED(s) || TILES(s) < PACK_AHEAD) continue;
        first[s] = j;
        for (int c = 0; c < (seq_lens[s] + KEYS - 1) / KEYS; c++) step_seq[j++] = s;
    }
#undef TILES
#undef SERVED
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < num_steps * num_kv_heads; it++) {
            int64_t step = it / num_kv_heads;
            int s = step_seq[step], g = (int)(it % num_kv_heads), c0 = (int)(step - first[s]) * KEYS;
            int n = seq_lens[s] - c0 < KEYS ? seq_lens[s] - c0 : KEYS;
            pack_step(vpack + it * v_step, in_place ? NULL : kpack + it * k_step, k_cache, v_cache,
                      cs0, cs1, cs2, block_tables + (int64_t)s * bts0, block_size, g, c0, n, dim);
        }
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        T_CONFIG(&cfg);
        scratch_t sc;
        int64_t rows = (int64_t)group * ROWS;
        sc.qt = zalloc(rows * dim * 2);
        sc.o = zalloc(rows * dim * 4);
        sc.m = zalloc(rows * 4);
        sc.l = zalloc(rows * 4);
        sc.vp = zalloc(v_step * 4);
        sc.k = zalloc(k_step * 2);
        sc.st = zalloc(KEYS * ROWS * 4);
        sc.pt = zalloc(ROWS * 16 * 4);
        int ok = sc.qt && sc.o && sc.m && sc.l && sc.vp && sc.k && sc.st && sc.pt;
        if (!ok) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items; it++) {
            if (!ok) continue;
            const work_t w = work_item(items, it, query_start_loc, seq_lens, block_tables, bts0);
            const int g = w.g, s = w.seq, t0 = w.t0, nt = w.nt, ctx0 = w.ctx0, ctx_end = w.ctx_end;
            const int32_t *table = w.table;
            for (int h = 0; h < group; h++)
                for (int kk = 0; kk < dim / 32; kk++) {
                    __m512i x[16];
                    for (int r = 0; r < ROWS; r++)
                        x[r] = r < nt ? _mm512_loadu_si512(query + (t0 + r) * qs0 + (g * group + h) * qs1 + kk * 32)
                                      : _mm512_setzero_si512();
                    transpose16(x);
                    int32_t *dst = sc.qt + ((int64_t)h * (dim / 32) + kk) * 256;
                    for (int i = 0; i < 16; i++) _mm512_store_si512(dst + i * 16, x[i]);
                }
            start_item(sc.o, sc.m, sc.l, rows, dim);
            for (int c0 = 0; c0 < ctx_end; c0 += KEYS) {
                int n = ctx_end - c0 < KEYS ? ctx_end - c0 : KEYS;
                const int32_t *vp = sc.vp;
                const uint16_t *k0 = sc.k, *k1;
                if (first[s] < 0) {
                    pack_step(sc.vp, in_place ? NULL : sc.k, k_cache, v_cache, cs0, cs1, cs2, table,
                              block_size, g, c0, n, dim);
                } else {
                    int64_t packed = (first[s] + c0 / KEYS) * num_kv_heads + g;
                    vp = vpack + packed * v_step;
                    if (!in_place) k0 = kpack + packed * k_step;
                }
                int64_t kstride;
                if (in_place) {  /* a 16-key tile: 16 rows of one block, cs1 apart */
                    int p1 = n > 16 ? c0 + 16 : c0;
                    k0 = k_cache + (int64_t)table[c0 / block_size] * cs0 + (c0 % block_size) * cs1 + g * cs2;
                    k1 = k_cache + (int64_t)table[p1 / block_size] * cs0 + (p1 % block_size) * cs1 + g * cs2;
                    kstride = cs1;
                } else {
                    k1 = k0 + 16 * dim;
                    kstride = dim;
                }
                for (int h = 0; h < group; h++)
                    step_head(&sc, h, dim, k0, k1, kstride, vp, n, ctx0 - c0, scale);
            }
            for (int h = 0; h < group; h++)
                for (int r = 0; r < nt; r++) {
                    const float *o = sc.o + ((int64_t)h * ROWS + r) * dim;
                    __m512 inv = _mm512_set1_ps(1.f / sc.l[h * ROWS + r]);
                    uint16_t *dst = out + (t0 + r) * os0 + (g * group + h) * os1;
                    for (int d = 0; d < dim; d += 16)
                        _mm256_storeu_si256((__m256i *)(dst + d),
                                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + d), inv)));
                }
        }
        T_RELEASE();
        free(sc.qt); free(sc.o); free(sc.m); free(sc.l); free(sc.vp); free(sc.k); free(sc.st); free(sc.pt);
    }
done:
    free(items); free(first); free(step_seq); free(vpack); free(kpack);
    return failed ? -1 : 0;
}
#else
int amx_request(void) { return -1; }
int uses_amx(void) { return 0; }
int amx_prefill(void) { return -1; }
#endif
"""


_KERNEL = paged_call.TileKernel("amx_prefill", _SOURCE, torch.bfloat16,
                              lambda lib: lib.amx_request() == 0)
available = _KERNEL.available
supports = _KERNEL.supports
prefill = _KERNEL.prefill
