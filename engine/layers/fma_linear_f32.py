"""float32 linear layers with FMA vectors (AVX-512, or AVX2 with FMA).

A decode step streams every weight of the model past a few dozen rows.
oneDNN's float32 matmul (``packed.py``) blocks those rows for reuse and,
on 64 rows of SmolLM2, spends about as long re-reading and re-blocking as
multiplying. This kernel streams each weight byte from memory once per
step: the weight is packed so that each 16 outputs are one run of ``K``
64-byte rows (``w[n0:n0 + 16, k]`` for k = 0, 1, ...), and a register block
of 6 rows times ``nr`` such groups accumulates with one FMA per (row, vector
of outputs, k), the row's input broadcast from memory. The row blocks of
one output group re-read its panel (K x 16 nr floats) from L2. Prefill-
sized batches are compute-bound, and there the same loop keeps level with
oneDNN (packed.py has the numbers), so it serves every row count.

- AVX-512: a group of 16 outputs is one register; ``nr`` (2-4 groups) is
  chosen per call so that the groups share out evenly over the threads
  that run (36 blocks of 16 outputs over two threads: 12 groups of 3, not
  9 of 4); 6 x 4 accumulators of the 32 registers.
- AVX2 with FMA: a group is two 8-float registers and ``nr`` is 1: 6 x 2
  accumulators, the two weight vectors and the broadcast fill 15 of the 16
  registers (the classic 6 x 16 block).

Each output is summed in input order (k = 0, 1, ...) in float32, a
different order from MKL's and oneDNN's blocked sums, so outputs may
differ from ``F.linear``'s in the last bits, as the oneDNN path already
does. Only where the CPU has one of the two and the kernel builds
(``available``).
"""

from __future__ import annotations

import functools

import torch

from engine.layers import linear_abi

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#if defined(__AVX512F__)
typedef __m512 V;
#define VW 16
#define NR 4
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VFMA _mm512_fmadd_ps
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VADD _mm512_add_ps
#define BUILT 1
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 V;
#define VW 8
#define NR 1
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VFMA _mm256_fmadd_ps
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
#define VADD _mm256_add_ps
#define BUILT 1
#else
#define BUILT 0
#endif

#if BUILT
#define MR 6          /* rows per register block */
#define VG (16 / VW)  /* vectors per group of 16 outputs */

/* y[0:mr, 0:16 nr] for one register block: `w` is the first of nr groups of
   16 outputs, each `k_in` rows of 16. Inlined with constant mr and nr, so
   the accumulators live in registers. */
static inline __attribute__((always_inline)) void block(
    float *y, int64_t y_stride, const float *x, int64_t x_stride, const float *w,
    const float *bias, int64_t k_in, const int mr, const int nr)
{
    V acc[MR][NR * VG];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr * VG; j++) acc[m][j] = VZERO();
    for (int64_t k = 0; k < k_in; k++) {
        V wv[NR * VG];
        for (int j = 0; j < nr; j++)
            for (int h = 0; h < VG; h++) wv[j * VG + h] = VLOAD(w + (j * k_in + k) * 16 + h * VW);
        for (int m = 0; m < mr; m++) {
            V xv = VSET1(x[m * x_stride + k]);
            for (int j = 0; j < nr * VG; j++) acc[m][j] = VFMA(xv, wv[j], acc[m][j]);
        }
    }
    for (int j = 0; j < nr * VG; j++) {
        V bv = bias ? VLOAD(bias + j * VW) : VZERO();
        for (int m = 0; m < mr; m++) VSTORE(y + m * y_stride + j * VW, VADD(acc[m][j], bv));
    }
}

#define ROWS_CASE(nr_)                                                                   \
    switch (mr) {                                                                        \
    case 1: block(y, y_stride, x, x_stride, w, bias, k_in, 1, nr_); break;              \
    case 2: block(y, y_stride, x, x_stride, w, bias, k_in, 2, nr_); break;              \
    case 3: block(y, y_stride, x, x_stride, w, bias, k_in, 3, nr_); break;              \
    case 4: block(y, y_stride, x, x_stride, w, bias, k_in, 4, nr_); break;              \
    case 5: block(y, y_stride, x, x_stride, w, bias, k_in, 5, nr_); break;              \
    default: block(y, y_stride, x, x_stride, w, bias, k_in, 6, nr_); break;             \
    }

static void dispatch(float *y, int64_t y_stride, const float *x, int64_t x_stride,
                     const float *w, const float *bias, int64_t k_in, int mr, int nr)
{
#if NR == 1
    ROWS_CASE(1)
#else
    switch (nr) {
    case 1: ROWS_CASE(1) break;
    case 2: ROWS_CASE(2) break;
    case 3: ROWS_CASE(3) break;
    default: ROWS_CASE(4) break;
    }
#endif
}

/* The groups of 16 outputs per register block (2 to NR; 1 where NR is 1)
   that share `blocks` out most evenly over `threads`: the fewest blocks on
   the busiest thread, then the widest group. */
static int group_width(int64_t blocks, int threads)
{
    int best = NR;
    int64_t best_load = -1;
    for (int nr = NR; nr >= 2; nr--) {
        int64_t groups = (blocks + nr - 1) / nr;
        int64_t load = (groups + threads - 1) / threads * nr;
        if (best_load < 0 || load < best_load) { best = nr; best_load = load; }
    }
    return best;
}

/* y[m, n] = sum_k x[m, k] w[n, k] + bias[n] for m < rows, n < n_out, from
   the packed layout (see the module docstring). x rows are `x_stride`
   floats apart, y rows `y_stride`. */
int linear_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride,
               const float *packed, const float *bias, int64_t rows,
               int64_t k_in, int64_t n_out)
{
    if (n_out % 16 || rows <= 0 || k_in <= 0) return -1;
    const int64_t blocks = n_out / 16;
    const int nr_max = group_width(blocks, omp_get_max_threads());
    const int64_t groups = (blocks + nr_max - 1) / nr_max;
    /* NOTE: dynamic, not static: a server's other threads and processes
       (gRPC, the gateway) preempt one of the team now and then, and with a
       static split the others then wait at the barrier for its share. A
       64-request SmolLM2 bf16 decode step beside a process busy ~25% of one
       core: 71-74 ms static, 66 dynamic; alone 55 and 52. */
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t b = g * nr_max;
        const int nr = blocks - b < nr_max ? (int)(blocks - b) : nr_max;
        for (int64_t m0 = 0; m0 < rows; m0 += MR) {
            const int mr = rows - m0 < MR ? (int)(rows - m0) : MR;
            dispatch(y + m0 * y_stride + b * 16, y_stride, x + m0 * x_stride, x_stride,
                     packed + b * k_in * 16, bias ? bias + b * 16 : 0, k_in, mr, nr);
        }
    }
    return 0;
}
#else
int linear_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride,
               const float *packed, const float *bias, int64_t rows,
               int64_t k_in, int64_t n_out) { return -1; }
#endif

/* 1 where the kernel was compiled in (the compiler saw AVX-512F, or AVX2 and FMA). */
int linear_f32_built(void) { return BUILT; }
"""

@functools.cache
def _lib():
    return linear_abi.load("fma_linear_f32", _SOURCE, "linear_f32",
                           lambda lib: lib.linear_f32_built())


def available() -> bool:
    """Whether this CPU and compiler run the kernel."""
    return _lib() is not None


def fits(weight: torch.Tensor) -> bool:
    """Whether ``pack`` takes this weight: 2-D float32, outputs a multiple of 16."""
    return weight.dim() == 2 and weight.dtype == torch.float32 and weight.shape[0] % 16 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] as N / 16 runs of K vectors of 16 outputs: [N / 16, K, 16]."""
    if not fits(weight):
        raise ValueError(f"fma_linear_f32 packs 2-D float32 weights with a multiple of 16 "
                         f"outputs, not {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D float32 ``x``, from ``pack(weight)``."""
    return linear_abi.run_packed(_lib().linear_f32, x, packed, out_features, bias, "fma_linear_f32")
