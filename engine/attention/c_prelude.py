"""C helpers both CPU kernel libraries start with (attention and the layer
ops): 16-float vectors, a vectorised exp, and bfloat16 in and out with
torch's rounding. Prepended to each library's source before it is built."""

VECTOR_MATH = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

/* NOTE: always inlined: where the CPU has no 64-byte registers (AVX2), a vf
   passed to or returned from a call goes through memory, and GCC did not
   inline vexp into silu16 by itself (a 64 x 1536 float32 SiLU*mul:
   360 -> 275 us). */
#define VINLINE static inline __attribute__((always_inline))

VINLINE vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

VINLINE vf clamp(vf x, float lo, float hi) {
    vi below = x < splat(lo), above = x > splat(hi);
    x = (vf)(((vi)x & ~below) | ((vi)splat(lo) & below));
    return (vf)(((vi)x & ~above) | ((vi)splat(hi) & above));
}

/* exp(x), 2^n * e^r with |r| <= ln2/2 and a degree-6 Taylor polynomial (~2 ulp). */
VINLINE vf vexp(vf x) {
    x = clamp(x, -87.f, 88.f);
    vf n = (x * splat(1.44269504f) + splat(12582912.f)) - splat(12582912.f);
    vf r = x - n * splat(0.693145752f) - n * splat(1.42860677e-6f);
    vf p = splat(1.f / 720);
    p = p * r + splat(1.f / 120);
    p = p * r + splat(1.f / 24);
    p = p * r + splat(1.f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.f);
    p = p * r + splat(1.f);
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

VINLINE float bf16_in(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

VINLINE uint16_t bf16_out(float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 16 bfloat16 values in and out at once; the same rounding as bf16_out. */

/* 16 bfloat16 bit patterns as the float32 values they are. */
VINLINE vf bf16_widen16(vh h) {
    vf f;
#ifdef __AVX512F__
    /* NOTE: the same widening as below, in one instruction: GCC split
       __builtin_convertvector's into four (two 8-lane widenings, an
       extract and an insert) when tuning for a CPU that prefers 256-bit
       vectors, as it does for Sapphire Rapids. */
    __m256i packed;
    memcpy(&packed, &h, sizeof packed);
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(packed), 16);
#else
    vu u = __builtin_convertvector(h, vu) << 16;
#endif
    memcpy(&f, &u, sizeof f);
    return f;
}

VINLINE vf bf16_load16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return bf16_widen16(h);
}

/* The float32 bits of x rounded to bfloat16 (low 16 bits zero). */
VINLINE vu bf16_bits16(vf x) {
    vu u;
    memcpy(&u, &x, sizeof u);
    vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (rounded & ~nan) | ((u | 0x400000u) & 0xffff0000u & nan);
}

/* x as 16 bfloat16 values, rounded as bf16_out. Where the CPU converts in
   one instruction (AVX512-BF16), that instruction: it rounds to nearest
   even and quiets NaNs as bf16_out does, but reads subnormal inputs as
   zero, so a vector holding one takes the bit arithmetic instead. (A
   bfloat16 RMSNorm with its residual add, and SiLU*mul, spent most of
   their time in that arithmetic: three roundings per element.) */
VINLINE vh bf16_pack16(vf x) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    __m512i u;
    memcpy(&u, &x, sizeof u);
    __mmask16 subnormal = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000))
                          & _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x007fffff));
    if (!subnormal) {
        __m512 f;
        memcpy(&f, &x, sizeof f);
        __m256bh h = _mm512_cvtneps_pbh(f);
        vh out;
        memcpy(&out, &h, sizeof out);
        return out;
    }
#endif
    return __builtin_convertvector(bf16_bits16(x) >> 16, vh);
}

VINLINE void bf16_store16(uint16_t *p, vf x) {
    vh h = bf16_pack16(x);
    memcpy(p, &h, sizeof h);
}

/* x rounded to bfloat16 and back: what a bf16 intermediate keeps of it. */
VINLINE vf bf16_round16(vf x) { return bf16_widen16(bf16_pack16(x)); }
"""
