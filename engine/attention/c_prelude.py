"""C helpers both CPU kernel libraries start with (attention and the layer
ops): 16-float vectors, a vectorised exp, and bfloat16 in and out with
torch's rounding. Prepended to each library's source before it is built."""

VECTOR_MATH = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));

static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline vf clamp(vf x, float lo, float hi) {
    vi below = x < splat(lo), above = x > splat(hi);
    x = (vf)(((vi)x & ~below) | ((vi)splat(lo) & below));
    return (vf)(((vi)x & ~above) | ((vi)splat(hi) & above));
}

/* exp(x), 2^n * e^r with |r| <= ln2/2 and a degree-6 Taylor polynomial (~2 ulp). */
static inline vf vexp(vf x) {
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

static inline float bf16_in(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_out(float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
"""
