"""C source of the decode attention with its accumulators in registers.

Part of cpu_attention.py's library (spliced in after the tiles of
c_tiles.py, whose helpers it uses, where the compiler has AVX-512; with
AVX2 alone, c_decode_avx2.py's tiles take its place). A
decode is one query token: for one kv head its ``group`` query heads score
the cached keys 16 at a time and sum the values in float32. The tile
kernels serve any tile of up to 16 query rows, so their running sums live
in memory and every value row costs a load and a store per accumulator;
here the dtype, ``group`` and the head size are constants at each call site
(``DECODE_SHAPES``), so the ``group x head_dim / 16`` running sums stay in
registers.

- bfloat16 (where the CPU has AVX512-BF16): each score is a chain of
  ``vdpbf16ps`` over the head's 32-element pairs, the same arithmetic in the
  same order as ``attend_tile_bf16`` for a one-token tile.
- float32: each score's 16 lanes of products are summed by FMA, then the
  16 keys' partial sums are reduced together (``reduce16``) instead of one
  horizontal sum per key as ``attend_tile`` does; the softmax steps over 16
  keys instead of 32. So outputs match ``attend_tile``'s up to float32
  rounding order.
"""

from engine.attention import c_decode_avx2

# (group, 32-element vectors per head) pairs specialised: the query rows'
# accumulators must fit in the 32 vector registers with room to spare.
DECODE_SHAPES = [(g, 2) for g in range(1, 7)] + [(g, 4) for g in range(1, 4)]

SOURCE = r"""
/* Query token t's `G` heads of kv head g against its `ctx` cached keys;
   `NP` 32-element vectors per head, dtype `DT` (F32 or BF16). */
static inline __attribute__((always_inline)) void attend_decode(
    void *out, int64_t os0, int64_t os1, const void *query, int64_t qs0, int64_t qs1,
    const char *k_cache, const char *v_cache, int64_t cs0, int64_t cs1, int64_t cs2,
    const int32_t *table, int64_t t, int ctx, int g, const int G, const int NP,
    int block_size, float scale, const int DT)
{
    const int NV = 2 * NP, esz = DT == F32 ? 4 : 2;
    /* bf16: NP vectors of 32 query elements each; f32: NV of 16. */
    vf q[6][8], acc[6][8];
    float pr[6][16] __attribute__((aligned(64))), m[6], l[6];
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int r = 0; r < G; r++) {
        const char *qr = (const char *)query + (t * qs0 + ((int64_t)g * G + r) * qs1) * esz;
        for (int j = 0; j < (DT == F32 ? NV : NP); j++) memcpy(&q[r][j], qr + j * 64, 64);
        for (int j = 0; j < NV; j++) acc[r][j] = splat(0.f);
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    for (int c0 = 0; c0 < ctx; c0 += 16) {
        int n = ctx - c0 < 16 ? ctx - c0 : 16;
        const char *krow[16], *vrow[16];
        /* Prefetching into L2 rather than L1 took a 64-sequence bf16 decode's
           attention from 21.6 to 15.8 ms a step (30 layers, interleaved runs). */
        chunk_rows(krow, vrow, k_cache, v_cache, table, block_size, cs0, cs1, cs2, g, c0, n,
                   ctx, NV * W * esz, esz);
        vi keep = lane < n;
        for (int r = 0; r < G; r++) {
            vf part[16];
            for (int i = 0; i < 16; i++) {
                vf a = splat(0.f);
                for (int j = 0; j < (DT == F32 ? NV : NP); j++) {
                    vf k;
                    memcpy(&k, krow[i] + j * 64, 64);
#if HAVE_DPBF16
                    if (DT == BF16) a = _mm512_dpbf16_ps(a, (__m512bh)q[r][j], (__m512bh)k);
                    else
#endif
                    a = _mm512_fmadd_ps(q[r][j], k, a);
                }
                part[i] = a;
            }
            vf p;
            float alpha = softmax_step16(reduce16(part) * splat(scale), keep, &m[r], &l[r], &p);
            for (int j = 0; j < NV; j++) acc[r][j] *= splat(alpha);
            memcpy(pr[r], &p, sizeof p);
        }
        for (int i = 0; i < n; i++) {
            vf v[8];
            for (int j = 0; j < NV; j++) v[j] = load(vrow[i] + j * W * esz, DT);
            for (int r = 0; r < G; r++) {
                vf pv = splat(pr[r][i]);
                for (int j = 0; j < NV; j++) acc[r][j] += pv * v[j];
            }
        }
    }
    for (int r = 0; r < G; r++) {
        char *o = (char *)out + (t * os0 + ((int64_t)g * G + r) * os1) * esz;
        vf inv = splat(l[r] > 0.f ? 1.f / l[r] : 0.f);
        for (int j = 0; j < NV; j++) {
            vf x = acc[r][j] * inv;
            if (DT == F32) memcpy(o + j * 64, &x, sizeof x);
            else bf16_store16((uint16_t *)o + j * W, x);
        }
    }
}

/* Whether (group, np) is one of DECODE_SHAPES. */
static int decode_shape(int group, int np)
{
#define DECODE(G_, NP_) if (group == G_ && np == NP_) return 1;
    DECODE_CASES
#undef DECODE
    return 0;
}

/* The decode in `dtype`, for a shape decode_shape accepts (bf16 only where
   HAVE_DPBF16). */
static void decode_fast(
    void *out, int64_t os0, int64_t os1, const void *query, int64_t qs0, int64_t qs1,
    const char *k_cache, const char *v_cache, int64_t cs0, int64_t cs1, int64_t cs2,
    const int32_t *table, int64_t t, int ctx, int g, int group, int np, int block_size,
    float scale, int dtype)
{
#define DECODE_DT(G_, NP_, DT_) attend_decode(out, os0, os1, query, qs0, qs1, k_cache, \
        v_cache, cs0, cs1, cs2, table, t, ctx, g, G_, NP_, block_size, scale, DT_)
#if HAVE_DPBF16
#define DECODE(G_, NP_) if (group == G_ && np == NP_) { \
        if (dtype == BF16) DECODE_DT(G_, NP_, BF16); else DECODE_DT(G_, NP_, F32); return; }
#else
#define DECODE(G_, NP_) if (group == G_ && np == NP_) { DECODE_DT(G_, NP_, F32); return; }
#endif
    DECODE_CASES
#undef DECODE
#undef DECODE_DT
}
"""


def source() -> str:
    """The C text, with one specialised call per shape in ``DECODE_SHAPES``
    where the compiler has AVX-512, else c_decode_avx2.py's decode."""
    cases = " ".join(f"DECODE({g}, {np})" for g, np in DECODE_SHAPES)
    return ("#ifdef __AVX512F__\n" + SOURCE.replace("DECODE_CASES", cases)
            + "#else\n" + c_decode_avx2.SOURCE + "#endif\n")
