"""bfloat16 linear layers for decode-sized batches with AMX tiles.

A decode step multiplies a few dozen rows by every weight of the model, so
its matmuls are a stream of weight bytes: their speed is the speed at which
a core reads memory. oneDNN's bf16 matmul (``packed.py``) reaches about half
of what two cores stream here (~11 of ~22 GB/s) on 64 rows. This kernel is
built for that shape: the weight is repacked once into the tile layout AMX
multiplies (for each 16 output columns, its 32-input tiles one after
another, so each core reads one contiguous run of the weight), and each
weight tile is loaded once and multiplied into the accumulators of up to 64
rows (four 16 x 16 float32 tiles), with the next tiles prefetched.

Float32 accumulation as oneDNN's, in its own order (bfloat16 outputs may
differ from ``F.linear``'s by one rounding). Only where the CPU has AMX and
the kernel builds (``available``); elsewhere ``PackedWeight`` takes
avx512_linear.py's kernel (the same layout) or oneDNN, and larger batches
(prefill) go to ``F.linear``, whose blocking for reuse wins there.
"""

from __future__ import annotations

import functools

import torch

from engine.layers import linear_abi

# Rows at or below which PackedWeight takes this kernel.
MAX_ROWS = 128

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out AMX state only to processes that ask (torch's oneDNN asks
   too; asking twice is harmless). 0 when granted. */
int amx_request(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

#define PREFETCH 8  /* weight tiles ahead (8 KB): 4-32 measured alike */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* y[m, n] = bf16(sum_k x[m, k] w[n, k] + bias[n]) for m < rows (<= 64 per
   call of the block loop below), n < n_out. `packed`: for each block of 16
   outputs, K / 32 tiles of 16 x 32 bf16 pairs (see pack in Python). x rows
   are `x_stride` elements apart and padded to a multiple of 16 rows by the
   caller. */
int amx_linear_bf16(uint16_t *y, int64_t y_stride, const uint16_t *x, int64_t x_stride,
                    const uint16_t *packed, const uint16_t *bias, int64_t rows,
                    int64_t k_in, int64_t n_out)
{
    if (k_in % 32 || n_out % 16 || rows % 16 || rows <= 0) return -1;
    const int64_t kt = k_in / 32, nb = n_out / 16;
    #pragma omp parallel
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 6; t++) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        float acc[4][16][16] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            const char *wb = (const char *)(packed + b * kt * 512);
            for (int64_t m0 = 0; m0 < rows; m0 += 64) {
                int mt = rows - m0 >= 64 ? 4 : (int)((rows - m0) / 16);
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                const char *xa = (const char *)(x + m0 * x_stride);
                for (int64_t k = 0; k < kt; k++) {
                    for (int l = 0; l < 1024; l += 64) _mm_prefetch(wb + (k + PREFETCH) * 1024 + l, _MM_HINT_T0);
                    _tile_loadd(5, wb + k * 1024, 64);
                    const char *xk = xa + k * 64;
                    /* Tile numbers must be constants: one line per accumulator. */
                    _tile_loadd(4, xk, x_stride * 2);
                    _tile_dpbf16ps(0, 4, 5);
                    if (mt > 1) { _tile_loadd(4, xk + 16 * x_stride * 2, x_stride * 2); _tile_dpbf16ps(1, 4, 5); }
                    if (mt > 2) { _tile_loadd(4, xk + 32 * x_stride * 2, x_stride * 2); _tile_dpbf16ps(2, 4, 5); }
                    if (mt > 3) { _tile_loadd(4, xk + 48 * x_stride * 2, x_stride * 2); _tile_dpbf16ps(3, 4, 5); }
                }
                _tile_stored(0, acc[0], 64);
                if (mt > 1) _tile_stored(1, acc[1], 64);
                if (mt > 2) _tile_stored(2, acc[2], 64);
                if (mt > 3) _tile_stored(3, acc[3], 64);
                __m512 bv = _mm512_setzero_ps();
                if (bias) bv = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + b * 16))), 16));
                for (int t = 0; t < mt; t++)
                    for (int r = 0; r < 16; r++) {
                        __m512 v = _mm512_add_ps(_mm512_load_ps(acc[t][r]), bv);
                        /* round to nearest even, as torch; NaN kept quiet */
                        __m512i u = _mm512_castps_si512(v);
                        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
                        __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
                        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                        rounded = _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x400000));
                        __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
                        _mm256_storeu_si256((__m256i *)(y + (m0 + t * 16 + r) * y_stride + b * 16), h);
                    }
            }
        }
        _tile_release();
    }
    return 0;
}
#else
int amx_request(void) { return -1; }
int amx_linear_bf16(uint16_t *y, int64_t y_stride, const uint16_t *x, int64_t x_stride,
                    const uint16_t *packed, const uint16_t *bias, int64_t rows,
                    int64_t k_in, int64_t n_out) { return -1; }
#endif
"""

@functools.cache
def _lib():
    return linear_abi.load("amx_linear", _SOURCE, "amx_linear_bf16",
                           lambda lib: lib.amx_request() == 0)


def available() -> bool:
    """Whether this CPU and compiler run the kernel."""
    return _lib() is not None


def fits(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ([out, in] bfloat16) has the shape the tiles need."""
    out_features, in_features = weight.shape
    return weight.dtype == torch.bfloat16 and out_features % 16 == 0 and in_features % 32 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in the kernel's layout: for each block of 16
    outputs, its tiles of 32 inputs, each 16 rows (input pairs) x 16 columns
    (outputs) of bf16 pairs."""
    out_features, in_features = weight.shape
    pairs = weight.detach().contiguous().view(torch.int32)  # [out, in / 2]: input pairs
    tiles = pairs.view(out_features // 16, 16, in_features // 32, 16)  # (block, col, tile, row)
    return tiles.permute(0, 2, 3, 1).contiguous().view(torch.bfloat16).view(-1)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D bfloat16 ``x`` of at most
    ``MAX_ROWS`` rows, from ``pack(weight)``."""
    rows, in_features = x.shape
    padded = -rows % 16
    if padded or x.stride(-1) != 1:
        x = torch.cat([x, x.new_zeros(padded, in_features)]) if padded else x.contiguous()
    y = torch.empty(rows + padded, out_features, dtype=torch.bfloat16)
    rc = _lib().amx_linear_bf16(
        y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), packed.data_ptr(),
        None if bias is None else bias.data_ptr(), rows + padded, in_features, out_features,
    )
    if rc != 0:
        raise ValueError(f"amx_linear cannot multiply {tuple(x.shape)} by a weight of "
                         f"{out_features} outputs")
    return y[:rows] if padded else y
