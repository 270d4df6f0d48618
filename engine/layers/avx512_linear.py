"""bfloat16 linear layers for decode-sized batches with AVX512-BF16.

The CPUs with bf16 dot products but no AMX tiles (AMD's Zen 4 and later,
Intel's Cooper Lake) get this kernel where amx_linear.py's cannot run. A
decode step is a stream of weight bytes multiplied into a few dozen rows;
oneDNN's matmul re-blocks the rows for reuse and reads the weight more than
once. Here the weight takes amx_linear.py's layout (for each 16 outputs,
their input pairs one after another, each pair of 16 outputs one 64-byte
vector), and a register block of 4 such 16-output groups times 6 rows is
accumulated with ``vdpbf16ps``: each weight vector is loaded once per 6 rows
and each row's input pair once per 64 outputs. The row blocks of one output
group re-read it from L2, so memory sees each weight byte once per step.

Float32 accumulation in input-pair order, so the bfloat16 outputs may
differ from ``F.linear``'s by one rounding, as with the AMX kernel. Only
where the CPU has AVX512-BF16 and the kernel builds (``available``).
"""

from __future__ import annotations

import functools

import torch

from engine.attention.c_prelude import VECTOR_MATH
from engine.layers import linear_abi
from engine.layers.amx_linear import fits, pack  # noqa: F401  (the same weight layout)

# Rows at or below which PackedWeight takes this kernel, F.linear above.
# NOTE: past the decode sizes it was written for: on a 2-core AMD EPYC with
# AVX512-BF16, SmolLM2's four matmul shapes over 30 layers took 78 ms at 144
# rows against F.linear's 90, 286 against 289 at 512, and lost from 1024 (613
# against 582). An engine step that adds one 128-token prompt to 16 decoding
# requests went from 136 to 108 ms, and served at 5 requests a second the
# time to first token fell with it (docs/benchmarks.md, 6 December).
MAX_ROWS = 512

_SOURCE = VECTOR_MATH + r"""
#include <immintrin.h>

#if defined(__AVX512BF16__)

#define MR 6  /* rows per register block */
#define NR 4  /* 16-output groups per register block: MR * NR accumulators */

/* y[0:mr, 0:16 nr] for one register block: `w` is the first of nr groups of
   16 outputs, each `pairs` vectors of 16 input pairs. Inlined with constant
   mr and nr, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void block(
    uint16_t *y, int64_t y_stride, const uint16_t *x, int64_t x_stride, const int32_t *w,
    const uint16_t *bias, int64_t pairs, const int mr, const int nr)
{
    __m512 acc[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[NR];
        for (int j = 0; j < nr; j++)
            wv[j] = (__m512bh)_mm512_loadu_si512(w + (j * pairs + p) * 16);
        for (int m = 0; m < mr; m++) {
            int32_t pair;  /* x may sit at any even or odd element */
            memcpy(&pair, x + m * x_stride + 2 * p, 4);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < nr; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
        }
    }
    for (int j = 0; j < nr; j++) {
        vf bv = bias ? bf16_load16(bias + j * 16) : splat(0.f);
        for (int m = 0; m < mr; m++) bf16_store16(y + m * y_stride + j * 16, (vf)acc[m][j] + bv);
    }
}

#define ROWS_CASE(nr_)                                                                   \
    switch (mr) {                                                                        \
    case 1: block(y, y_stride, x, x_stride, w, bias, pairs, 1, nr_); break;             \
    case 2: block(y, y_stride, x, x_stride, w, bias, pairs, 2, nr_); break;             \
    case 3: block(y, y_stride, x, x_stride, w, bias, pairs, 3, nr_); break;             \
    case 4: block(y, y_stride, x, x_stride, w, bias, pairs, 4, nr_); break;             \
    case 5: block(y, y_stride, x, x_stride, w, bias, pairs, 5, nr_); break;             \
    default: block(y, y_stride, x, x_stride, w, bias, pairs, 6, nr_); break;            \
    }

static void dispatch(uint16_t *y, int64_t y_stride, const uint16_t *x, int64_t x_stride,
                     const int32_t *w, const uint16_t *bias, int64_t pairs, int mr, int nr)
{
    switch (nr) {
    case 1: ROWS_CASE(1) break;
    case 2: ROWS_CASE(2) break;
    case 3: ROWS_CASE(3) break;
    default: ROWS_CASE(4) break;
    }
}

/* y[m, n] = bf16(sum_k x[m, k] w[n, k] + bias[n]) for m < rows, n < n_out,
   from amx_linear's packed layout. x rows are `x_stride` elements apart. */
int avx512_linear_bf16(uint16_t *y, int64_t y_stride, const uint16_t *x, int64_t x_stride,
                       const uint16_t *packed, const uint16_t *bias, int64_t rows,
                       int64_t k_in, int64_t n_out)
{
    if (k_in % 32 || n_out % 16 || rows <= 0) return -1;
    const int64_t pairs = k_in / 2, blocks = n_out / 16, groups = (blocks + NR - 1) / NR;
    const int32_t *w = (const int32_t *)packed;
    /* NOTE: dynamic, not static: a server's other threads and processes
       (gRPC, the gateway) preempt one of the team now and then, and with a
       static split the others then wait at the barrier for its share. A
       64-request SmolLM2 bf16 decode step beside a process busy ~25% of one
       core: 71-74 ms static, 66 dynamic; alone 55 and 52. */
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t b = g * NR;
        const int nr = blocks - b < NR ? (int)(blocks - b) : NR;
        for (int64_t m0 = 0; m0 < rows; m0 += MR) {
            const int mr = rows - m0 < MR ? (int)(rows - m0) : MR;
            dispatch(y + m0 * y_stride + b * 16, y_stride, x + m0 * x_stride, x_stride,
                     w + b * pairs * 16, bias ? bias + b * 16 : 0, pairs, mr, nr);
        }
    }
    return 0;
}
#else
int avx512_linear_bf16(uint16_t *y, int64_t y_stride, const uint16_t *x, int64_t x_stride,
                       const uint16_t *packed, const uint16_t *bias, int64_t rows,
                       int64_t k_in, int64_t n_out) { return -1; }
#endif

/* 1 where the kernel was compiled in (the compiler saw AVX512-BF16). */
int avx512_bf16_built(void)
{
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
"""

@functools.cache
def _lib():
    return linear_abi.load("avx512_linear", _SOURCE, "avx512_linear_bf16",
                           lambda lib: lib.avx512_bf16_built())


def available() -> bool:
    """Whether this CPU and compiler run the kernel."""
    return _lib() is not None


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D bfloat16 ``x``, from
    ``pack(weight)``."""
    return linear_abi.run_packed(_lib().avx512_linear_bf16, x, packed, out_features, bias, "avx512_linear")
