"""C source of the attention tiles cpu_attention.py's kernel is made of.

``attend_tile`` scores a tile of up to 16 query rows (consecutive new tokens
of one sequence, times the query heads of one or more kv heads) against the
sequence's cached keys read in place through its block table, float32 or
bfloat16 widened to float32, with an online softmax 32 keys at a time;
``attend_tile_bf16`` is the same walk with AVX512-BF16 dot products for the
scores, 16 keys at a time, where the compiler has them (``HAVE_DPBF16``);
the decodes of c_decode.py follow where it has AVX-512 or AVX2 with FMA
(``HAVE_FAST_DECODE``).
cpu_attention.py adds the dispatcher (``paged_attention``) and ``store_kv``.
Needs c_prelude.VECTOR_MATH before it.
"""

from engine.attention import c_decode

_SOURCE = r"""
#include <omp.h>
#include <stdlib.h>

enum { F32 = 0, BF16 = 1 };
#define W 16          /* floats per vector */
#define MAX_VECS 16   /* head_dim <= 256 */
#define MAX_ROWS 16   /* query rows per work item: tokens x query heads per kv head */
#define CHUNK 32      /* keys per online-softmax step */

/* 16 elements as float32; bf16 is the top half of a float32. */
static inline __attribute__((always_inline)) vf load(const void *p, int dtype) {
    vf x;
    if (dtype == F32) {
        memcpy(&x, p, sizeof x);
    } else {
        x = bf16_load16((const uint16_t *)p);
    }
    return x;
}

static inline vf vmax(vf a, vf b) {
    vi keep = a > b;
    return (vf)(((vi)a & keep) | ((vi)b & ~keep));
}

#ifdef __clang__
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE(v, ...) __builtin_shuffle(v, (vi){__VA_ARGS__})
#endif

static inline float hsum(vf v) {
    v += SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/* The largest of v's lanes, by halves as hsum (exact, as any max is). */
static inline float hmax(vf v) {
    v = vmax(v, SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

/* A tile of `nt` consecutive query tokens of one sequence (starting at
   token t0, which sees `ctx0` keys; token t0 + i sees ctx0 + i) against the
   cached keys, for the `group` query heads of kv head `g`: rows = nt * group,
   row r is token r / group, head r % group. Each key and value row is loaded
   once for all rows. `nv` (vectors per head) and `dtype` are constants at
   each call site, so this is specialised per head size and dtype. */
static inline __attribute__((always_inline)) void attend_tile(
    void *out, int64_t os0, int64_t os1, const void *query, int64_t qs0, int64_t qs1,
    const char *k_cache, const char *v_cache, int64_t cs0, int64_t cs1, int64_t cs2,
    const int32_t *table, int64_t t0, int nt, int ctx0, int g, int hk, int group, const int nv,
    int block_size, float scale, const int dtype)
{
    const int esz = dtype == F32 ? 4 : 2;
    const int per_token = hk * group, rows = nt * per_token;
    vf q[MAX_ROWS][MAX_VECS], acc[MAX_ROWS][MAX_VECS];
    float sc[MAX_ROWS][CHUNK] __attribute__((aligned(64))), m[MAX_ROWS], l[MAX_ROWS];
    for (int r = 0; r < rows; r++) {
        int64_t t = t0 + r / per_token, h = (int64_t)g * group + r % per_token;
        const char *qr = (const char *)query + (t * qs0 + h * qs1) * esz;
        for (int j = 0; j < nv; j++) {
            q[r][j] = load(qr + j * W * esz, dtype);
            acc[r][j] = splat(0.f);
        }
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    const int ctx_max = ctx0 + nt - 1;
    for (int c0 = 0; c0 < ctx_max; c0 += CHUNK) {
        int n = ctx_max - c0 < CHUNK ? ctx_max - c0 : CHUNK;
        /* The next chunk's rows, across block boundaries (as attend_tile_bf16),
           into L2 (locality 1), as chunk_rows. */
        for (int i = 0; i < CHUNK && c0 + CHUNK + i < ctx_max; i++) {
            int pos = c0 + CHUNK + i;
            int64_t off = (int64_t)table[pos / block_size] * cs0 + (pos % block_size) * cs1 + g * cs2;
            for (int b = 0; b < hk * nv * W * esz; b += 64) {
                __builtin_prefetch(k_cache + off * esz + b, 0, 1);
                __builtin_prefetch(v_cache + off * esz + b, 0, 1);
            }
        }
        for (int i = 0; i < n; i++) {
            int pos = c0 + i;
            int64_t off = (int64_t)table[pos / block_size] * cs0 + (pos % block_size) * cs1 + g * cs2;
            for (int kh = 0; kh < hk; kh++) {
                vf k[MAX_VECS];
                for (int j = 0; j < nv; j++) k[j] = load(k_cache + (off + kh * cs2 + j * W) * esz, dtype);
                for (int ti = 0; ti < nt; ti++)
                    for (int r = ti * per_token + kh * group; r < ti * per_token + (kh + 1) * group; r++) {
                        vf s = q[r][0] * k[0];
                        for (int j = 1; j < nv; j++) s += q[r][j] * k[j];
                        sc[r][i] = hsum(s) * scale;
                    }
            }
        }
        for (int r = 0; r < rows; r++) {
            int valid = ctx0 + r / per_token - c0;  /* keys of this chunk row r sees */
            valid = valid < 0 ? 0 : valid < n ? valid : n;
            for (int i = valid; i < CHUNK; i++) sc[r][i] = -INFINITY;
            vf v0, v1;
            memcpy(&v0, sc[r], sizeof v0);
            memcpy(&v1, sc[r] + W, sizeof v1);
            float mx = hmax(vmax(v0, v1));
            mx = mx > m[r] ? mx : m[r];
            v0 = vexp(v0 - splat(mx));
            v1 = vexp(v1 - splat(mx));
            memcpy(sc[r], &v0, sizeof v0);
            memcpy(sc[r] + W, &v1, sizeof v1);
            float sum = 0.f;
            for (int i = 0; i < valid; i++) sum += sc[r][i];
            for (int i = valid; i < CHUNK; i++) sc[r][i] = 0.f;
            float alpha = expf(m[r] - mx);
            l[r] = l[r] * alpha + sum;
            m[r] = mx;
            if (alpha != 1.f)
                for (int j = 0; j < nv; j++) acc[r][j] *= splat(alpha);
        }
        for (int i = 0; i < n; i++) {
            int pos = c0 + i;
            int64_t off = (int64_t)table[pos / block_size] * cs0 + (pos % block_size) * cs1 + g * cs2;
            /* Tokens before `first_token` do not see key `pos` (p = 0): skipped. */
            int first_token = pos < ctx0 ? 0 : pos - ctx0 + 1;
            for (int kh = 0; kh < hk; kh++) {
                vf v[MAX_VECS];
                for (int j = 0; j < nv; j++) v[j] = load(v_cache + (off + kh * cs2 + j * W) * esz, dtype);
                for (int ti = first_token; ti < nt; ti++)
                    for (int r = ti * per_token + kh * group; r < ti * per_token + (kh + 1) * group; r++) {
                        vf p = splat(sc[r][i]);
                        for (int j = 0; j < nv; j++) acc[r][j] += p * v[j];
                    }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        int64_t t = t0 + r / per_token, h = (int64_t)g * group + r % per_token;
        char *o = (char *)out + (t * os0 + h * os1) * esz;
        vf inv = splat(l[r] > 0.f ? 1.f / l[r] : 0.f);
        for (int j = 0; j < nv; j++) {
            vf x = acc[r][j] * inv;
            if (dtype == F32) {
                memcpy(o + j * W * 4, &x, sizeof x);
            } else {
                for (int e = 0; e < W; e++) ((uint16_t *)o)[j * W + e] = bf16_out(x[e]);
            }
        }
    }
}

#ifdef __AVX512BF16__
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define HAVE_FAST_DECODE 1

/* v[0..15] -> one vector whose lane i is the sum of v[i]'s lanes: a tree of
   two-input shuffles that halves the vectors and their lanes at each level. */
static inline vf reduce16(vf *v) {
#define PICK(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
    vf a[8], b[4], c[2];
    for (int j = 0; j < 8; j++)
        a[j] = PICK(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + PICK(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)
        b[j] = PICK(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + PICK(a[2 * j], a[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        c[j] = PICK(b[2 * j], b[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + PICK(b[2 * j], b[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return PICK(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + PICK(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#undef PICK
}

/* The cache rows of keys c0 .. c0 + 15 of kv head g into krow and vrow
   (those past n: key c0's, so every pointer is valid), then the next 16
   keys' first `bytes` asked for; elements are `esz` bytes. They are in
   other blocks, wherever the table puts them, so the hardware prefetcher
   cannot run ahead across the jump: ask for them now, while this chunk
   computes. Into L2: asking for L1 stalls on its few miss buffers (30
   decode layers of 64 sequences, 21 query heads over 3 kv heads: 40.5 ->
   33.0 ms; float32 with shuffled tables, 46.6 -> 40.4; interleaved runs). */
static inline __attribute__((always_inline)) void chunk_rows(
    const char **krow, const char **vrow, const char *k_cache, const char *v_cache,
    const int32_t *table, int block_size, int64_t cs0, int64_t cs1, int64_t cs2, int g, int c0,
    int n, int end, int bytes, const int esz)
{
    for (int i = 0; i < 16; i++) {
        int pos = c0 + (i < n ? i : 0);
        int64_t off = (int64_t)table[pos / block_size] * cs0 + (pos % block_size) * cs1 + g * cs2;
        krow[i] = k_cache + off * esz;
        vrow[i] = v_cache + off * esz;
    }
    for (int i = 0; i < 16 && c0 + 16 + i < end; i++) {
        int pos = c0 + 16 + i;
        int64_t off = (int64_t)table[pos / block_size] * cs0 + (pos % block_size) * cs1 + g * cs2;
        for (int b = 0; b < bytes; b += 64) {
            _mm_prefetch(k_cache + off * esz + b, _MM_HINT_T2);
            _mm_prefetch(v_cache + off * esz + b, _MM_HINT_T2);
        }
    }
}

/* One query row's online-softmax step over 16 scores, those outside `keep`
   masked: `p` gets their weights (0 where masked), the row's running max
   `m` and sum `l` move on, and the factor its running sums of values must
   be scaled by is returned. */
static inline __attribute__((always_inline)) float softmax_step16(vf sc, vi keep, float *m,
                                                                  float *l, vf *p)
{
    sc = (vf)(((vi)sc & keep) | ((vi)splat(-INFINITY) & ~keep));
    float mx = hmax(sc);
    mx = mx > *m ? mx : *m;
    *p = (vf)((vi)vexp(sc - splat(mx)) & keep);
    float alpha = expf(*m - mx);
    *l = *l * alpha + hsum(*p);
    *m = mx;
    return alpha;
}

#if HAVE_DPBF16
/* attend_tile for bfloat16 with AVX512-BF16, over `hk` adjacent kv heads
   from `g` at once, so that one pass over the keys reads whole cache rows
   (a token's heads are adjacent). Row r is token r / (hk * group) of the
   tile and query head g * group + r % (hk * group). Each score is a dot
   product of bfloat16 pairs accumulated in float32 (vdpbf16ps, products
   exact), 16 keys at a time, their partial sums reduced together; softmax
   and the weighted sum of values as in attend_tile, in float32. `np` =
   32-element vectors per head row. */
static inline __attribute__((always_inline)) void attend_tile_bf16(
    void *out, int64_t os0, int64_t os1, const void *query, int64_t qs0, int64_t qs1,
    const char *k_cache, const char *v_cache, int64_t cs0, int64_t cs1, int64_t cs2,
    const int32_t *table, int64_t t0, int nt, int ctx0, int g, int hk, int group, const int np,
    int block_size, float scale)
{
    const int per_token = hk * group, rows = nt * per_token, nv = 2 * np;
    __m512bh q[MAX_ROWS][MAX_VECS / 2];
    vf acc[MAX_ROWS][MAX_VECS];
    float pr[MAX_ROWS][16] __attribute__((aligned(64))), m[MAX_ROWS], l[MAX_ROWS];
    int64_t head_off[MAX_ROWS];  /* bytes from a token's first head to row r's kv head */
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int r = 0; r < rows; r++) {
        int64_t t = t0 + r / per_token, h = (int64_t)g * group + r % per_token;
        const char *qr = (const char *)query + (t * qs0 + h * qs1) * 2;
        for (int j = 0; j < np; j++) memcpy(&q[r][j], qr + j * 64, 64);
        for (int j = 0; j < nv; j++) acc[r][j] = splat(0.f);
        head_off[r] = (r % per_token / group) * cs2 * 2;
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    const int ctx_max = ctx0 + nt - 1;
    for (int c0 = 0; c0 < ctx_max; c0 += 16) {
        int n = ctx_max - c0 < 16 ? ctx_max - c0 : 16;
        const char *krow[16], *vrow[16];
        chunk_rows(krow, vrow, k_cache, v_cache, table, block_size, cs0, cs1, cs2, g, c0, n,
                   ctx_max, hk * nv * 32, 2);
        for (int r = 0; r < rows; r++) {
            int valid = ctx0 + r / per_token - c0;  /* keys of this chunk row r sees */
            valid = valid < 0 ? 0 : valid < n ? valid : n;
            if (valid == 0) {
                memset(pr[r], 0, sizeof pr[r]);
                continue;
            }
            vf part[16];
            for (int i = 0; i < 16; i++) {
                vf a = splat(0.f);
                for (int j = 0; j < np; j++) {
                    __m512bh k;
                    memcpy(&k, krow[i] + head_off[r] + j * 64, 64);
                    a = _mm512_dpbf16_ps(a, q[r][j], k);
                }
                part[i] = a;
            }
            vf p;
            float alpha = softmax_step16(reduce16(part) * splat(scale), lane < valid, &m[r], &l[r], &p);
            if (alpha != 1.f)
                for (int j = 0; j < nv; j++) acc[r][j] *= splat(alpha);
            memcpy(pr[r], &p, sizeof p);
        }
        for (int i = 0; i < n; i++) {
            int pos = c0 + i;
            /* Tokens before `first_token` of the tile do not see key `pos`. */
            int first_token = pos < ctx0 ? 0 : pos - ctx0 + 1;
            for (int kh = 0; kh < hk; kh++) {
                vf v[MAX_VECS];
                for (int j = 0; j < nv; j++) v[j] = load(vrow[i] + kh * cs2 * 2 + j * 32, BF16);
                for (int ti = first_token; ti < nt; ti++)
                    for (int r = ti * per_token + kh * group; r < ti * per_token + (kh + 1) * group; r++) {
                        vf pv = splat(pr[r][i]);
                        for (int j = 0; j < nv; j++) acc[r][j] += pv * v[j];
                    }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        int64_t t = t0 + r / per_token, h = (int64_t)g * group + r % per_token;
        uint16_t *o = (uint16_t *)((char *)out + (t * os0 + h * os1) * 2);
        vf inv = splat(l[r] > 0.f ? 1.f / l[r] : 0.f);
        for (int j = 0; j < nv; j++) bf16_store16(o + j * W, acc[r][j] * inv);
    }
}
#endif  /* HAVE_DPBF16 */
DECODE_SOURCE
#else
#define HAVE_FAST_DECODE 0
#endif  /* AVX-512, or AVX2 with FMA */
#ifndef HAVE_FAST_TILES  /* float32 tiles of c_decode_avx2.py (AVX2 without AVX-512) */
#define HAVE_FAST_TILES 0
#endif
"""


def source() -> str:
    """The C text, with the specialised decodes spliced in."""
    return _SOURCE.replace("DECODE_SOURCE", c_decode.source())
