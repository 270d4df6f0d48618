"""C source of the float32 attention tiles for CPUs with AVX2 but no AVX-512.

Spliced in by c_decode.py in place of its register-accumulator decode where
the compiler has AVX2 and FMA but not AVX-512, and used for every float32
tile there, decodes and prompts alike (``tile_fast``; ``HAVE_FAST_TILES``).
The generic tiles of c_tiles.py work on 16-float vectors, which GCC keeps
in memory on AVX2 (there are no 64-byte registers), and sum each key's
score horizontally, a chain of cross-lane shuffles per key;
the register-accumulator decode keeps ``group x head_dim`` floats of sums
live, twice what AVX2's sixteen 8-float registers hold. So here:

- scores, 8 keys at a time for one query row: the query's 8-float slices
  are loaded once each and multiplied into 8 per-key partial sums, which
  one transposing reduction (``reduce8``) turns into the 8 keys' scores;
- the online softmax is c_tiles.py's, over 16 keys (two such groups);
- the weighted sum of values runs slice by slice of the head: up to 6 query
  rows' sums of one 8-float slice stay in registers while every value row
  of the chunk passes once, then go back to a small array in L1;
- a tile's later tokens see more keys: each row masks the keys past its own.

Float32 only (an AVX2 host runs float32 by default); bfloat16 keeps the
generic tiles. Each score is summed in another order than the tiles' and the
AVX-512 decode's, so outputs match theirs up to float32 rounding.
"""

SOURCE = r"""
#define HAVE_FAST_TILES 1

/* s[i] = the sum of a[i]'s 8 lanes, for the 8 vectors a[0..7]. */
static inline __m256 reduce8(const __m256 *a)
{
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    t0 = _mm256_hadd_ps(t0, t1);  /* a0..a3: low 128-bit halves | high halves */
    t2 = _mm256_hadd_ps(t2, t3);  /* a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20),
                         _mm256_permute2f128_ps(t0, t2, 0x31));
}

/* acc[r][j slice] = acc * alpha[r] + sum_i pr[r][i] * v_i for R constant
   rows from r0: their sums of one 8-float slice stay in registers while the
   chunk's n value rows pass. */
static inline __attribute__((always_inline)) void weigh_values(
    float (*acc)[MAX_VECS * W], float (*pr)[16], const float *alpha, const char **vrow,
    int n, int n8, int r0, const int R)
{
    for (int j = 0; j < n8; j++) {
        __m256 o[6];
        for (int r = 0; r < R; r++)
            o[r] = _mm256_mul_ps(_mm256_load_ps(acc[r0 + r] + 8 * j), _mm256_set1_ps(alpha[r0 + r]));
        for (int i = 0; i < n; i++) {
            __m256 v = _mm256_loadu_ps((const float *)vrow[i] + 8 * j);
            for (int r = 0; r < R; r++)
                o[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&pr[r0 + r][i]), v, o[r]);
        }
        for (int r = 0; r < R; r++) _mm256_store_ps(acc[r0 + r] + 8 * j, o[r]);
    }
}

/* Every (group, np) tile_fast takes: any the generic tiles take (np =
   32-element vectors per head). The dispatcher reads it as c_decode.py's. */
static int decode_shape(int group, int np)
{
    return group >= 1 && group <= MAX_ROWS && np >= 1 && 2 * np <= MAX_VECS;
}

/* A tile of `nt` consecutive query tokens of one sequence from t0 (token
   t0 + i sees ctx0 + i keys), for the `group` query heads of kv head g:
   row r is token r / group, head r % group; float32. */
static void tile_fast(
    void *out, int64_t os0, int64_t os1, const void *query, int64_t qs0, int64_t qs1,
    const char *k_cache, const char *v_cache, int64_t cs0, int64_t cs1, int64_t cs2,
    const int32_t *table, int64_t t0, int nt, int ctx0, int g, int group, int np,
    int block_size, float scale)
{
    const int n8 = 4 * np, head_dim = 32 * np, rows = nt * group;  /* n8: 8-float slices */
    float acc[MAX_ROWS][MAX_VECS * W] __attribute__((aligned(32)));
    float pr[MAX_ROWS][16] __attribute__((aligned(64))), m[MAX_ROWS], l[MAX_ROWS];
    float alpha[MAX_ROWS];
    const float *q[MAX_ROWS];
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int r = 0; r < rows; r++) {
        q[r] = (const float *)query + (t0 + r / group) * qs0 + ((int64_t)g * group + r % group) * qs1;
        memset(acc[r], 0, sizeof(float) * head_dim);
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    const int ctx_max = ctx0 + nt - 1;
    for (int c0 = 0; c0 < ctx_max; c0 += 16) {
        int n = ctx_max - c0 < 16 ? ctx_max - c0 : 16;
        const char *krow[16], *vrow[16];
        chunk_rows(krow, vrow, k_cache, v_cache, table, block_size, cs0, cs1, cs2, g, c0, n,
                   ctx_max, head_dim * 4, 4);
        for (int r = 0; r < rows; r++) {
            int valid = ctx0 + r / group - c0;  /* keys of this chunk row r sees */
            valid = valid < 0 ? 0 : valid < n ? valid : n;
            if (valid == 0) {  /* a later token's key: nothing to add, nothing to rescale */
                memset(pr[r], 0, sizeof pr[r]);
                alpha[r] = 1.f;
                continue;
            }
            __m256 s[2];
            for (int half = 0; half < 2; half++) {
                __m256 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
                for (int j = 0; j < n8; j++) {
                    __m256 qj = _mm256_loadu_ps(q[r] + 8 * j);
                    for (int i = 0; i < 8; i++)
                        a[i] = _mm256_fmadd_ps(qj, _mm256_loadu_ps((const float *)krow[8 * half + i] + 8 * j), a[i]);
                }
                s[half] = reduce8(a);
            }
            vf sc, p;
            memcpy(&sc, s, sizeof sc);
            alpha[r] = softmax_step16(sc * splat(scale), lane < valid, &m[r], &l[r], &p);
            memcpy(pr[r], &p, sizeof p);
        }
        for (int r0 = 0; r0 < rows; r0 += 6) {
            switch (rows - r0 < 6 ? rows - r0 : 6) {
            case 1: weigh_values(acc, pr, alpha, vrow, n, n8, r0, 1); break;
            case 2: weigh_values(acc, pr, alpha, vrow, n, n8, r0, 2); break;
            case 3: weigh_values(acc, pr, alpha, vrow, n, n8, r0, 3); break;
            case 4: weigh_values(acc, pr, alpha, vrow, n, n8, r0, 4); break;
            case 5: weigh_values(acc, pr, alpha, vrow, n, n8, r0, 5); break;
            default: weigh_values(acc, pr, alpha, vrow, n, n8, r0, 6); break;
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float *o = (float *)((char *)out + ((t0 + r / group) * os0
                                            + ((int64_t)g * group + r % group) * os1) * 4);
        __m256 inv = _mm256_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f);
        for (int j = 0; j < n8; j++)
            _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(_mm256_load_ps(acc[r] + 8 * j), inv));
    }
}
"""
