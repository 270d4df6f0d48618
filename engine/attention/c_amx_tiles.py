"""C source shared by amx_prefill.py's kernel: its tile operations and vector helpers.

``TILE_OPS`` defines ``T_ZERO``, ``T_LOAD``, ``T_STORE``, ``T_DP`` (a 16 x 16
bf16-pair tile multiply-accumulate into float32), ``T_CONFIG`` and
``T_RELEASE`` as AMX instructions where the compiler targets AMX; elsewhere
only ``T_CONFIG`` and ``T_RELEASE``, as no-ops (c_flash_step.py then
computes its products in AVX512-BF16 registers). ``HELPERS``: a vectorised
exponential and a 16 x 16 transpose of 32-bit lanes. Both sit inside the
kernel's ``#if defined(__AVX512BF16__)``.
"""

TILE_OPS = r"""
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
int amx_request(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }
int uses_amx(void) { return 1; }
#define T_ZERO(t) _tile_zero(t)
#define T_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define T_STORE(t, p, stride) _tile_stored(t, p, stride)
#define T_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define T_CONFIG(cfg) _tile_loadconfig(cfg)
#define T_RELEASE() _tile_release()
#else
/* No AMX: no tiles to configure or release. */
int amx_request(void) { return 0; }
int uses_amx(void) { return 0; }
#define T_CONFIG(cfg) ((void)(cfg))
#define T_RELEASE() ((void)0)
#endif
""".strip("\n")

HELPERS = r"""
/* exp(x), 2^(x log2 e) as 2^n * 2^f, |f| <= 1/2, degree-6 Taylor (~1e-7). */
static inline __m512 exp16(__m512 x) {
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* Rows r[0..15] of 16 int32 (bf16 pairs) -> their transpose, in place. */
static inline void transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4a + c], 128-bit lane L: column c + 4L of rows 4a .. 4a + 3 */
    for (int a = 0; a < 4; a++) {
        u[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
        u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
        __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
        __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
        r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[c + 4] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
        r[c + 8] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[c + 12] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
    }
}
""".strip("\n")
