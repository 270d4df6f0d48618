"""C source of cpu_ops.py's kernels: RMSNorm (with the residual add), SiLU
times up, rotary and the bfloat16 argmax, in bfloat16 and float32. Built by
cpu_ops.py after c_prelude.VECTOR_MATH, with ``-ffp-contract=off``; what each
kernel promises against kernels/reference.py is in cpu_ops.py's docstring.
"""

SOURCE = r"""
/* 8-float halves of the 16-lane vectors. NOTE: a loop-carried sum is kept in
   two of these, not in one 16-float vf: where the CPU has no 64-byte
   registers (AVX2), GCC keeps such a vf in memory and moves it through
   general registers every iteration (a 64 x 576 float32 RMSNorm took 63 us,
   most of it stalled on that). The lanes and their order are the same. */
typedef float vf8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef uint16_t vh8 __attribute__((vector_size(16)));

VINLINE vf8 load8(const void *p, int bf16) {
    vf8 v;
    if (bf16) {
        vh8 h;
        memcpy(&h, p, sizeof h);
        vu8 u = __builtin_convertvector(h, vu8) << 16;
        memcpy(&v, &u, sizeof v);
    } else {
        memcpy(&v, p, sizeof v);
    }
    return v;
}

/* The squares of row[0:vcols] (vcols a multiple of 16) summed in 16 lanes,
   then across the lanes in order. */
VINLINE float sum_squares16(const void *row, int64_t vcols, int bf16) {
    const int esz = bf16 ? 2 : 4;
    vf8 lo = {0}, hi = {0};
    for (int64_t j = 0; j < vcols; j += 16) {
        vf8 a = load8((const char *)row + j * esz, bf16);
        vf8 b = load8((const char *)row + (j + 8) * esz, bf16);
        lo += a * a;
        hi += b * b;
    }
    float sum = 0.f;
    for (int l = 0; l < 8; l++) sum += lo[l];
    for (int l = 0; l < 8; l++) sum += hi[l];
    return sum;
}
/* res_out = bf16(x + res) (or x); out = bf16(w * bf16(r * rsqrt(mean(r^2) + eps))).
   16 columns at a time; the squares are summed in 16 lanes, then across them. */
void rms_norm_bf16(uint16_t *out, uint16_t *res_out, const uint16_t *x, const uint16_t *res,
                   const uint16_t *weight, int64_t rows, int64_t cols, int64_t x_stride,
                   int64_t res_stride, float eps)
{
    const int64_t vcols = cols - cols % 16;
    #pragma omp parallel for schedule(static) if (rows * cols > 16384)
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *xi = x + i * x_stride;
        uint16_t *ri = res_out + i * cols, *oi = out + i * cols;
        if (res) {
            const uint16_t *si = res + i * res_stride;
            for (int64_t j = 0; j < vcols; j += 16)
                bf16_store16(ri + j, bf16_load16(xi + j) + bf16_load16(si + j));
            for (int64_t j = vcols; j < cols; j++) ri[j] = bf16_out(bf16_in(xi[j]) + bf16_in(si[j]));
        } else {
            memcpy(ri, xi, cols * sizeof(uint16_t));
        }
        float sum = sum_squares16(ri, vcols, 1);
        for (int64_t j = vcols; j < cols; j++) sum += bf16_in(ri[j]) * bf16_in(ri[j]);
        float r = 1.f / sqrtf(sum / (float)cols + eps);
        for (int64_t j = 0; j < vcols; j += 16)
            bf16_store16(oi + j, bf16_load16(weight + j) * bf16_round16(bf16_load16(ri + j) * splat(r)));
        for (int64_t j = vcols; j < cols; j++)
            oi[j] = bf16_out(bf16_in(weight[j]) * bf16_in(bf16_out(bf16_in(ri[j]) * r)));
    }
}

/* out = bf16(bf16(silu(gate)) * up) for x = [gate | up] rows, as F.silu(gate) * up. */
static inline float silu_scalar(float g) {
    return g / (1.f + expf(-(g < -87.f ? -87.f : g > 88.f ? 88.f : g)));
}

#ifdef __AVX512F__
#include <immintrin.h>
/* silu(g) = g / (1 + exp(-g)) for 16 lanes: the exponential as vexp's
   (2^n e^r, degree-6 polynomial) with fused multiply-adds. */
VINLINE vf silu16(vf g) {
    __m512 x = _mm512_max_ps(_mm512_min_ps(-g, splat(88.f)), splat(-87.f));
    __m512 n = _mm512_roundscale_ps(x * splat(1.44269504f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, splat(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, splat(1.42860677e-6f), r);
    __m512 p = splat(1.f / 720);
    p = _mm512_fmadd_ps(p, r, splat(1.f / 120));
    p = _mm512_fmadd_ps(p, r, splat(1.f / 24));
    p = _mm512_fmadd_ps(p, r, splat(1.f / 6));
    p = _mm512_fmadd_ps(p, r, splat(0.5f));
    p = _mm512_fmadd_ps(p, r, splat(1.f));
    p = _mm512_fmadd_ps(p, r, splat(1.f));
    return g / (_mm512_scalef_ps(p, n) + splat(1.f));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_SILU8 1
/* silu16's steps for 8 lanes with AVX2 (2^n as exponent bits: n is an
   integer in [-126, 127], so the product is scalef's, bit for bit). The
   float32 kernel calls it on 8-float registers: a 16-float vf lives in
   memory on this CPU. */
VINLINE __m256 silu8(__m256 g) {
    const __m256 one = _mm256_set1_ps(1.f);
    __m256 x = _mm256_max_ps(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g),
                                           _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, one);
    p = _mm256_fmadd_ps(p, r, one);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), one));
}

VINLINE vf silu16(vf g) {
    __m256 h[2];
    memcpy(h, &g, sizeof g);
    h[0] = silu8(h[0]);
    h[1] = silu8(h[1]);
    memcpy(&g, h, sizeof g);
    return g;
}
#else
VINLINE vf silu16(vf g) { return g / (splat(1.f) + vexp(-g)); }
#endif

void silu_mul_bf16(uint16_t *out, const uint16_t *x, int64_t rows, int64_t inner,
                   int64_t x_stride)
{
    const int64_t vinner = inner - inner % 16;
    #pragma omp parallel for schedule(static) if (rows * inner > 16384)
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *gate = x + i * x_stride, *up = gate + inner;
        uint16_t *o = out + i * inner;
        for (int64_t j = 0; j < vinner; j += 16)
            bf16_store16(o + j, bf16_round16(silu16(bf16_load16(gate + j))) * bf16_load16(up + j));
        for (int64_t j = vinner; j < inner; j++)
            o[j] = bf16_out(bf16_in(bf16_out(silu_scalar(bf16_in(gate[j])))) * bf16_in(up[j]));
    }
}

/* Float32: the same passes with no rounding to bfloat16 between them. */
VINLINE vf f32_load16(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
VINLINE void f32_store16(float *p, vf v) { memcpy(p, &v, sizeof v); }

void rms_norm_f32(float *out, float *res_out, const float *x, const float *res,
                  const float *weight, int64_t rows, int64_t cols, int64_t x_stride,
                  int64_t res_stride, float eps)
{
    const int64_t vcols = cols - cols % 16;
    #pragma omp parallel for schedule(static) if (rows * cols > 16384)
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * x_stride;
        float *ri = res_out + i * cols, *oi = out + i * cols;
        if (res) {
            const float *si = res + i * res_stride;
            for (int64_t j = 0; j < cols; j++) ri[j] = xi[j] + si[j];
        } else {
            memcpy(ri, xi, cols * sizeof(float));
        }
        float sum = sum_squares16(ri, vcols, 0);
        for (int64_t j = vcols; j < cols; j++) sum += ri[j] * ri[j];
        float r = 1.f / sqrtf(sum / (float)cols + eps);
        for (int64_t j = 0; j < vcols; j += 16)
            f32_store16(oi + j, f32_load16(weight + j) * (f32_load16(ri + j) * splat(r)));
        for (int64_t j = vcols; j < cols; j++) oi[j] = weight[j] * (ri[j] * r);
    }
}

void silu_mul_f32(float *out, const float *x, int64_t rows, int64_t inner, int64_t x_stride)
{
    const int64_t vinner = inner - inner % 16;
    #pragma omp parallel for schedule(static) if (rows * inner > 16384)
    for (int64_t i = 0; i < rows; i++) {
        const float *gate = x + i * x_stride, *up = gate + inner;
        float *o = out + i * inner;
#ifdef HAVE_SILU8
        for (int64_t j = 0; j < vinner; j += 8)
            _mm256_storeu_ps(o + j, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + j)),
                                                  _mm256_loadu_ps(up + j)));
#else
        for (int64_t j = 0; j < vinner; j += 16)
            f32_store16(o + j, silu16(f32_load16(gate + j)) * f32_load16(up + j));
#endif
        for (int64_t j = vinner; j < inner; j++) o[j] = silu_scalar(gate[j]) * up[j];
    }
}

static inline void rotate_f32(float *x, const float *c, const float *s, int half) {
    for (int j = 0; j < half; j++) {
        float x1 = x[j], x2 = x[j + half];
        float a = x1 * c[j], b = x2 * s[j], d = x2 * c[j], e = x1 * s[j];
        x[j] = a - b;
        x[j + half] = d + e;
    }
}

void rotary_f32(float *q, int64_t qs0, int64_t qs1, int q_heads,
                float *k, int64_t ks0, int64_t ks1, int k_heads,
                const int64_t *positions, const float *cos, const float *sin,
                int64_t num_tokens, int head_dim)
{
    int half = head_dim / 2;
    #pragma omp parallel for schedule(static) if (num_tokens > 256)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + positions[t] * half, *s = sin + positions[t] * half;
        for (int h = 0; h < q_heads; h++) rotate_f32(q + t * qs0 + h * qs1, c, s, half);
        for (int h = 0; h < k_heads; h++) rotate_f32(k + t * ks0 + h * ks1, c, s, half);
    }
}

/* In place, "rotate half": (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) for every head. */
static inline void rotate_bf16(uint16_t *x, const float *c, const float *s, int half) {
    for (int j = 0; j < half; j++) {
        float x1 = bf16_in(x[j]), x2 = bf16_in(x[j + half]);
        float a = x1 * c[j], b = x2 * s[j], d = x2 * c[j], e = x1 * s[j];
        x[j] = bf16_out(a - b);
        x[j + half] = bf16_out(d + e);
    }
}

void rotary_bf16(uint16_t *q, int64_t qs0, int64_t qs1, int q_heads,
                 uint16_t *k, int64_t ks0, int64_t ks1, int k_heads,
                 const int64_t *positions, const float *cos, const float *sin,
                 int64_t num_tokens, int head_dim)
{
    int half = head_dim / 2;
    #pragma omp parallel for schedule(static) if (num_tokens > 256)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + positions[t] * half, *s = sin + positions[t] * half;
        for (int h = 0; h < q_heads; h++) rotate_bf16(q + t * qs0 + h * qs1, c, s, half);
        for (int h = 0; h < k_heads; h++) rotate_bf16(k + t * ks0 + h * ks1, c, s, half);
    }
}

/* out[i] = the first index of row i's largest value, as torch.argmax on the
   rows widened to float32 (a NaN counts as the largest: its first index). */
void argmax_bf16(int64_t *out, const uint16_t *x, int64_t rows, int64_t cols, int64_t stride)
{
    const int64_t vcols = cols - cols % 16;
    #pragma omp parallel for schedule(static) if (rows * cols > 65536)
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *xi = x + i * stride;
        int64_t arg = 0;
        float best = bf16_in(xi[0]);
        int nan = best != best;
        if (vcols >= 16) {
            const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
            vf vbest = bf16_load16(xi);
            vi vidx = lane, vnan = vbest != vbest;
            for (int64_t j = 16; j < vcols; j += 16) {
                vf v = bf16_load16(xi + j);
                vi gt = v > vbest;  /* strict: a lane keeps its first maximum */
                vbest = (vf)(((vi)v & gt) | ((vi)vbest & ~gt));
                vidx = ((lane + (int32_t)j) & gt) | (vidx & ~gt);
                vnan |= v != v;
            }
            best = vbest[0];
            arg = vidx[0];
            for (int l = 1; l < 16; l++)
                if (vbest[l] > best || (vbest[l] == best && vidx[l] < arg)) {
                    best = vbest[l];
                    arg = vidx[l];
                }
            for (int l = 0; l < 16; l++) nan |= vnan[l] != 0;
        }
        for (int64_t j = vcols > 0 ? vcols : 1; j < cols; j++) {
            float v = bf16_in(xi[j]);
            nan |= v != v;
            if (v > best) {
                best = v;
                arg = j;
            }
        }
        if (nan)
            for (int64_t j = 0; j < cols; j++)
                if (bf16_in(xi[j]) != bf16_in(xi[j])) {
                    arg = j;
                    break;
                }
        out[i] = arg;
    }
}
"""
