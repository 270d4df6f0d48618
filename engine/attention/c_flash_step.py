"""C source of one 32-key step of amx_prefill.py's flash-attention loop.

``step_head``: for one query head of a work item (16 new tokens), the scores
``S^T = K Q^T`` of the step's keys (``step_scores``), the online softmax in
float32 (scores kept transposed, a lane per token, so the running max and sum
are plain vector operations; the max is raised lazily, by ``LAZY``), ``P``
rounded to bfloat16 pairs and ``O += P V`` in float32 (``step_pv``). The two
products run on AMX tiles where the compiler targets AMX, else in AVX512-BF16
registers (on tiles emulated in memory they took 1.6x as long: 1 x 2048
tokens, a layer of SmolLM2 on a 2-core AMD EPYC, 24.7 against 16.0 ms). ``pack_step``:
a step's values (and keys, where the blocks do not hold whole 16-key tiles)
repacked from the cache blocks into the tile layouts. Uses amx_prefill.py's
``scratch_t``, ``ROWS``, ``KEYS`` and c_amx_tiles.py's tile operations.
``SOFTMAX`` (the online softmax) and ``WORK_ITEMS`` (the work items both
tile kernels walk, in a cache-friendly order, a work item's numbers and its
start) serve f32_prefill.py too.
"""

SOFTMAX = r"""
/* NOTE: scores may run this far above the max the exponentials subtract
   before it is raised (and O, l rescaled): p <= e^8 stays exact enough in
   float32 and bfloat16 and spares a rescale on most steps. */
#define LAZY 8.f

/* The online softmax of one query head over a step's KEYS keys: scores
   S^T in st ([KEYS][ROWS], unscaled; keys past n ignored), the running max
   and sum of its ROWS tokens in mp and lp, their float32 output rows in o
   (ROWS x dim, rescaled where the max is raised). p[i] gets key i's weights
   for the 16 tokens (0 where masked). Token r sees the step's first
   seen0 + r keys; seen0 >= KEYS: all of them. */
static inline __attribute__((always_inline)) void online_softmax(
    const float *st, float *mp, float *lp, float *o, int dim, int n, int seen0, float scale,
    __m512 *p)
{
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 s[KEYS];
    __mmask16 vis[KEYS];
    __m512 mx[4] = {ninf, ninf, ninf, ninf};
    for (int i = 0; i < KEYS; i++) {
        /* key i is seen by tokens r with seen0 + r > i */
        int first = i - seen0 + 1;
        vis[i] = i >= n || first >= 16 ? 0 : first <= 0 ? 0xffff : (__mmask16)(0xffff << first);
        s[i] = _mm512_mul_ps(_mm512_load_ps(st + i * ROWS), vscale);
        if (i < n) mx[i % 4] = _mm512_mask_max_ps(mx[i % 4], vis[i], mx[i % 4], s[i]);
    }
    __m512 cmax = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
    __m512 m = _mm512_load_ps(mp), l = _mm512_load_ps(lp);
    __mmask16 raise = _mm512_cmp_ps_mask(cmax, _mm512_add_ps(m, _mm512_set1_ps(LAZY)), _CMP_GT_OQ);
    if (raise) {
        __m512 m_new = _mm512_mask_mov_ps(m, raise, cmax);
        float alpha[ROWS] __attribute__((aligned(64)));
        _mm512_store_ps(alpha, exp16(_mm512_sub_ps(m, m_new)));  /* 0 where m was -inf */
        l = _mm512_mask_mul_ps(l, raise, l, _mm512_load_ps(alpha));
        for (int r = 0; r < ROWS; r++) {
            if (!(raise >> r & 1)) continue;
            __m512 a = _mm512_set1_ps(alpha[r]);
            for (int d = 0; d < dim; d += 16)
                _mm512_store_ps(o + r * dim + d, _mm512_mul_ps(_mm512_load_ps(o + r * dim + d), a));
        }
        m = m_new;
    }
    __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int i = 0; i < KEYS; i++) {
        p[i] = vis[i] ? _mm512_maskz_mov_ps(vis[i], exp16(_mm512_sub_ps(s[i], m))) : _mm512_setzero_ps();
        sum[i % 2] = _mm512_add_ps(sum[i % 2], p[i]);
    }
    _mm512_store_ps(mp, m);
    _mm512_store_ps(lp, _mm512_add_ps(l, _mm512_add_ps(sum[0], sum[1])));
}
""".strip("\n")

WORK_ITEMS = r"""
typedef struct { int32_t seq, g, t0; } item_t;
typedef struct { int32_t len, seq; } by_len_t;

static int longest_first(const void *a, const void *b) {
    const by_len_t *x = a, *y = b;
    return x->len != y->len ? y->len - x->len : x->seq - y->seq;
}

static void *zalloc(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p) memset(p, 0, bytes);
    return p;
}

/* The work items, in the order the parallel loop hands them out: a query
   tile of ROWS new tokens of a sequence with min_query_len+ of them, for one
   kv head. One sequence's items come one after another, a tile's kv heads
   together (a cache row holds every head's key or value, so they read whole
   rows between them): the sequence's keys and values, MiBs for a long
   context, then stay in the last-level cache from tile to tile. Tiles
   ordered by their cost alone alternated between sequences of one length,
   and past the cache's size every tile read its keys from memory again (one
   layer, float32, 2 chunks of 512 after 5952 cached tokens: 97 ms against
   40 for one chunk, 83 ms in this order). Sequences longest first, and in
   each the tiles with the most keys first, so that a dynamic schedule ends
   on short items. *count gets their number: 0 (and NULL) when there are
   none, -1 (and NULL) when memory runs out. */
static item_t *work_items(const int32_t *query_start_loc, const int32_t *seq_lens, int num_seqs,
                          int num_kv_heads, int min_query_len, int64_t *count)
{
    *count = 0;
    if (num_seqs <= 0) return NULL;
    by_len_t *order = malloc(sizeof(by_len_t) * num_seqs);
    if (!order) {
        *count = -1;
        return NULL;
    }
    int64_t n = 0;
    int served = 0;
    for (int s = 0; s < num_seqs; s++) {
        int q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len < min_query_len) continue;
        n += (int64_t)(q_len + ROWS - 1) / ROWS * num_kv_heads;
        order[served++] = (by_len_t){seq_lens[s], s};
    }
    item_t *items = n ? malloc(sizeof(item_t) * n) : NULL;
    if (!items) {
        free(order);
        *count = n ? -1 : 0;
        return NULL;
    }
    qsort(order, served, sizeof(by_len_t), longest_first);
    int64_t k = 0;
    for (int i = 0; i < served; i++) {
        int s = order[i].seq, start = query_start_loc[s], end = query_start_loc[s + 1];
        int last = start + (end - start - 1) / ROWS * ROWS;
        for (int t0 = last; t0 >= start; t0 -= ROWS)
            for (int g = 0; g < num_kv_heads; g++) items[k++] = (item_t){s, g, t0};
    }
    free(order);
    *count = n;
    return items;
}

/* Work item `it` of a kernel's parallel loop, with what the loop derives from it. */
typedef struct {
    int seq, g, t0, nt;    /* sequence, kv head, the tile's first row, its tokens (<= ROWS) */
    int ctx0, ctx_end;     /* keys the tile's first token sees; its last sees ctx_end */
    const int32_t *table;  /* the sequence's block table */
} work_t;

static inline work_t work_item(const item_t *items, int64_t it, const int32_t *query_start_loc,
                               const int32_t *seq_lens, const int32_t *block_tables, int64_t bts0)
{
    item_t item = items[it];
    int s = item.seq, start = query_start_loc[s], end = query_start_loc[s + 1];
    int nt = end - item.t0 < ROWS ? end - item.t0 : ROWS;
    int ctx0 = seq_lens[s] - (end - start) + (item.t0 - start) + 1;
    return (work_t){s, item.g, item.t0, nt, ctx0, ctx0 + nt - 1, block_tables + (int64_t)s * bts0};
}

/* A work item's start: its float32 accumulators (rows x dim) zero, each
   row's running max -inf and sum 0. */
static void start_item(float *o, float *m, float *l, int64_t rows, int dim)
{
    memset(o, 0, rows * dim * 4);
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
}
""".strip("\n")

SOURCE = SOFTMAX + "\n\n" + r"""
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* S^T = K Q^T of a step's keys into st ([KEYS][ROWS]) on tiles. Tile
   numbers are constants: 0 and 1 hold the two 16-key halves' scores
   (independent chains, so one tile's multiply hides the other's latency). */
static inline void step_scores(float *st, const int32_t *qt, int dim, const uint16_t *k0,
                               const uint16_t *k1, int64_t kstride, int n)
{
    T_ZERO(0);
    T_ZERO(1);
    for (int kk = 0; kk < dim / 32; kk++) {
        T_LOAD(4, qt + kk * 256, 64);
        T_LOAD(2, k0 + kk * 32, kstride * 2);
        T_DP(0, 2, 4);
        if (n > 16) {
            T_LOAD(3, k1 + kk * 32, kstride * 2);
            T_DP(1, 3, 4);
        }
    }
    T_STORE(0, st, 64);
    if (n > 16) T_STORE(1, st + 16 * ROWS, 64);
}

/* O += P V on tiles, four 16-dim column tiles of O at a time (tiles 4-7). */
static inline void step_pv(float *o, const int32_t *pt, const int32_t *vp, int dim)
{
    T_LOAD(0, pt, 64);
    const int nd = dim / 16;  /* even */
    for (int c = 0; c < nd; c += 4) {
        const int four = c + 2 < nd;
        T_LOAD(4, o + c * 16, dim * 4);
        T_LOAD(5, o + (c + 1) * 16, dim * 4);
        T_LOAD(1, vp + c * 256, 64);
        T_LOAD(2, vp + (c + 1) * 256, 64);
        T_DP(4, 0, 1);
        T_DP(5, 0, 2);
        if (four) {
            T_LOAD(6, o + (c + 2) * 16, dim * 4);
            T_LOAD(7, o + (c + 3) * 16, dim * 4);
            T_LOAD(3, vp + (c + 2) * 256, 64);
            T_DP(6, 0, 3);
            T_LOAD(1, vp + (c + 3) * 256, 64);
            T_DP(7, 0, 1);
        }
        T_STORE(4, o + c * 16, dim * 4);
        T_STORE(5, o + (c + 1) * 16, dim * 4);
        if (four) {
            T_STORE(6, o + (c + 2) * 16, dim * 4);
            T_STORE(7, o + (c + 3) * 16, dim * 4);
        }
    }
}
#else
/* Without AMX the same two products in registers, as vdpbf16ps with one
   operand broadcast from memory: nothing is copied into tiles, and the
   accumulators stay in registers for a whole product. */

/* Scores of 8 keys (rows `kstride` elements apart from k) into st's rows:
   each key's dimension pair broadcast against Q^T's row of that pair (a lane
   per token), 8 independent chains. */
static inline void scores8(float *st, const int32_t *qt, int dim, const uint16_t *k,
                           int64_t kstride)
{
    __m512 acc[8];
    const int32_t *row[8];
    for (int m = 0; m < 8; m++) {
        acc[m] = _mm512_setzero_ps();
        row[m] = (const int32_t *)(k + m * kstride);
    }
    for (int p = 0; p < dim / 2; p++) {
        __m512bh q = (__m512bh)_mm512_load_si512(qt + p * 16);
        for (int m = 0; m < 8; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(row[m][p]), q);
    }
    for (int m = 0; m < 8; m++) _mm512_store_ps(st + m * ROWS, acc[m]);
}

/* S^T = K Q^T into st: the keys up to n, 8 at a time (rows past n in the
   last group are read, as a tile would be, and masked by the caller). */
static inline void step_scores(float *st, const int32_t *qt, int dim, const uint16_t *k0,
                               const uint16_t *k1, int64_t kstride, int n)
{
    for (int m0 = 0; m0 < n; m0 += 8) {
        const uint16_t *k = m0 < 16 ? k0 + m0 * kstride : k1 + (m0 - 16) * kstride;
        scores8(st + m0 * ROWS, qt, dim, k, kstride);
    }
}

/* O += P V: 8 tokens x 32 dimensions of O in 16 accumulators at a time, over
   the step's 16 key pairs (P's pair for a token broadcast against V's row of
   that pair). */
static inline void step_pv(float *o, const int32_t *pt, const int32_t *vp, int dim)
{
    for (int r0 = 0; r0 < ROWS; r0 += 8)
        for (int c = 0; c < dim / 16; c += 2) {  /* dim / 16 is even */
            __m512 acc[8][2];
            for (int r = 0; r < 8; r++)
                for (int j = 0; j < 2; j++)
                    acc[r][j] = _mm512_load_ps(o + (r0 + r) * dim + (c + j) * 16);
            for (int kp = 0; kp < 16; kp++) {
                __m512bh v0 = (__m512bh)_mm512_load_si512(vp + c * 256 + kp * 16);
                __m512bh v1 = (__m512bh)_mm512_load_si512(vp + (c + 1) * 256 + kp * 16);
                for (int r = 0; r < 8; r++) {
                    __m512bh b = (__m512bh)_mm512_set1_epi32(pt[(r0 + r) * 16 + kp]);
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, v0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, v1);
                }
            }
            for (int r = 0; r < 8; r++)
                for (int j = 0; j < 2; j++)
                    _mm512_store_ps(o + (r0 + r) * dim + (c + j) * 16, acc[r][j]);
        }
}
#endif

/* One query head's step over keys c0 .. c0 + n - 1: S^T = K Q^T, the online
   softmax, O += P V. `k0`, `k1`: the two 16-key halves (rows `kstride`
   elements apart; k1 unused when n <= 16). Token r sees the step's first
   seen0 + r keys; seen0 >= KEYS: all of them. */
static void step_head(scratch_t *sc, int h, int dim, const uint16_t *k0, const uint16_t *k1,
                      int64_t kstride, const int32_t *vp, int n, int seen0, float scale)
{
    const int32_t *qt = sc->qt + (int64_t)h * (dim / 32) * 256;
    step_scores(sc->st, qt, dim, k0, k1, kstride, n);
    float *o = sc->o + (int64_t)h * ROWS * dim;
    __m512 p[KEYS];
    online_softmax(sc->st, sc->m + h * ROWS, sc->l + h * ROWS, o, dim, n, seen0, scale, p);
    /* P^T rows (keys) -> bf16 pairs of keys per token -> transposed to P's rows. */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i x[16];
    for (int kp = 0; kp < 16; kp++)
        x[kp] = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(p[2 * kp + 1], p[2 * kp]));
    transpose16(x);
    for (int r = 0; r < ROWS; r++) _mm512_store_si512(sc->pt + r * 16, x[r]);
    step_pv(o, sc->pt, vp, dim);
}

/* One step of a sequence's cache, kv head g, keys c0 .. c0 + n - 1 (n <=
   KEYS), packed: values into `vp` ([dim / 16][16 key pairs][16 dims], pairs
   of keys interleaved), and keys into `kp` ([KEYS][dim]) unless it is NULL;
   zero past n. */
static void pack_step(int32_t *vp, uint16_t *kp, const uint16_t *k_cache, const uint16_t *v_cache,
                      int64_t cs0, int64_t cs1, int64_t cs2, const int32_t *table, int block_size,
                      int g, int c0, int n, int dim)
{
    const uint16_t *vrow[KEYS];
    for (int i = 0; i < n; i++) {
        int pos = c0 + i;
        int64_t off = (int64_t)table[pos / block_size] * cs0 + (pos % block_size) * cs1 + g * cs2;
        vrow[i] = v_cache + off;
        if (kp) memcpy(kp + i * dim, k_cache + off, dim * 2);
    }
    if (kp && n < KEYS) memset(kp + n * dim, 0, (KEYS - n) * dim * 2);
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int j = 0; j < KEYS / 2; j++) {
        const uint16_t *a = 2 * j < n ? vrow[2 * j] : NULL, *b = 2 * j + 1 < n ? vrow[2 * j + 1] : NULL;
        for (int d = 0; d < dim; d += 32) {
            __m512i va = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
            __m512i vb = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
            _mm512_store_si512(vp + ((d / 16) * 16 + j) * 16, _mm512_permutex2var_epi16(va, lo, vb));
            _mm512_store_si512(vp + ((d / 16 + 1) * 16 + j) * 16, _mm512_permutex2var_epi16(va, hi, vb));
        }
    }
}
""".strip("\n")
