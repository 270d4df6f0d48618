"""C source of the bfloat16 decode attention with its accumulators in registers.

Part of cpu_attention.py's library (spliced in after ``attend_tile_bf16``,
whose helpers it uses, where the compiler has AVX512-BF16). A decode is one
query token: for one kv head its ``group`` query heads score the cached keys
16 at a time with ``vdpbf16ps`` (as ``attend_tile_bf16`` does) and sum the
values in float32. ``attend_tile_bf16`` serves any tile of up to 16 query
rows, so its running sums live in memory and every value row costs a load
and a store per accumulator; here ``group`` and the head size are constants
at each call site (``DECODE_SHAPES``), so the ``group x head_dim / 16``
running sums stay in registers. Same arithmetic, in the same order, as
``attend_tile_bf16`` for a one-token tile.
"""

# (group, 32-element vectors per head) pairs specialised: the query rows'
# accumulators must fit in the 32 vector registers with room to spare.
DECODE_SHAPES = [(g, 2) for g in range(1, 7)] + [(g, 4) for g in range(1, 4)]

SOURCE = r"""
/* Query token t's `G` heads of kv head g against its `ctx` cached keys. */
static inline __attribute__((always_inline)) void attend_decode_bf16(
    void *out, int64_t os0, int64_t os1, const void *query, int64_t qs0, int64_t qs1,
    const char *k_cache, const char *v_cache, int64_t cs0, int64_t cs1, int64_t cs2,
    const int32_t *table, int64_t t, int ctx, int g, const int G, const int NP,
    int block_size, float scale)
{
    const int NV = 2 * NP;
    __m512bh q[6][4];
    vf acc[6][8];
    float pr[6][16] __attribute__((aligned(64))), m[6], l[6];
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int r = 0; r < G; r++) {
        const char *qr = (const char *)query + (t * qs0 + ((int64_t)g * G + r) * qs1) * 2;
        for (int j = 0; j < NP; j++) memcpy(&q[r][j], qr + j * 64, 64);
        for (int j = 0; j < NV; j++) acc[r][j] = splat(0.f);
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    for (int c0 = 0; c0 < ctx; c0 += 16) {
        int n = ctx - c0 < 16 ? ctx - c0 : 16;
        const char *krow[16], *vrow[16];
        /* Prefetching into L2 rather than L1 took a 64-sequence decode's
           attention from 21.6 to 15.8 ms a step (30 layers, interleaved runs). */
        chunk_rows_bf16(krow, vrow, k_cache, v_cache, table, block_size, cs0, cs1, cs2, g, c0, n,
                        ctx, NP * 64);
        vi keep = lane < n;
        for (int r = 0; r < G; r++) {
            vf part[16];
            for (int i = 0; i < 16; i++) {
                vf a = splat(0.f);
                for (int j = 0; j < NP; j++) {
                    __m512bh k;
                    memcpy(&k, krow[i] + j * 64, 64);
                    a = _mm512_dpbf16_ps(a, q[r][j], k);
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
            for (int j = 0; j < NV; j++) v[j] = load(vrow[i] + j * 32, BF16);
            for (int r = 0; r < G; r++) {
                vf pv = splat(pr[r][i]);
                for (int j = 0; j < NV; j++) acc[r][j] += pv * v[j];
            }
        }
    }
    for (int r = 0; r < G; r++) {
        uint16_t *o = (uint16_t *)((char *)out + (t * os0 + ((int64_t)g * G + r) * os1) * 2);
        vf inv = splat(l[r] > 0.f ? 1.f / l[r] : 0.f);
        for (int j = 0; j < NV; j++) bf16_store16(o + j * W, acc[r][j] * inv);
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

/* The decode, for a shape decode_shape accepts. */
static void decode_bf16(
    void *out, int64_t os0, int64_t os1, const void *query, int64_t qs0, int64_t qs1,
    const char *k_cache, const char *v_cache, int64_t cs0, int64_t cs1, int64_t cs2,
    const int32_t *table, int64_t t, int ctx, int g, int group, int np, int block_size, float scale)
{
#define DECODE(G_, NP_) if (group == G_ && np == NP_) { attend_decode_bf16(out, os0, os1, \
        query, qs0, qs1, k_cache, v_cache, cs0, cs1, cs2, table, t, ctx, g, G_, NP_, block_size, \
        scale); return; }
    DECODE_CASES
#undef DECODE
}
"""


def source() -> str:
    """The C text, with one specialised call per shape in ``DECODE_SHAPES``."""
    cases = " ".join(f"DECODE({g}, {np})" for g, np in DECODE_SHAPES)
    return SOURCE.replace("DECODE_CASES", cases)
