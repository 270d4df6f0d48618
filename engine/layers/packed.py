"""Matmuls on the CPU with the weight prepacked.

``F.linear`` on the CPU repacks the whole weight into the blocked layout
its kernels read on every call: oneDNN's AMX / AVX512-BF16 matmul in
bfloat16, MKL's sgemm in float32. For decode-sized batches that repack
costs about as much as the matmul itself. ``PackedWeight`` keeps a packed
copy, made on first use and again whenever the weight is replaced or written
(its data pointer or version counter changes):

- bfloat16: the bf16-pairs layout of amx_linear.py where a decode kernel
  for it runs, AMX tiles (amx_linear.py) or else AVX512-BF16 dot products
  (avx512_linear.py): decode-sized batches go through it (with AVX512-BF16,
  up to 512 rows: a decode step with a prompt in it too), larger ones
  through ``F.linear``, whose reorder is small beside their compute. Else
  oneDNN's own layout (the same outputs as ``F.linear``). The decode kernels
  accumulate in float32 in their own order, so their bfloat16 outputs may
  differ from ``F.linear``'s by one rounding. On an AMD EPYC without AMX,
  the AVX-512 kernel took a 64-request SmolLM2 decode step from 101-113 to
  82-87 ms (matmuls 59-67 to 50-60 ms), against oneDNN's packed weights.
- float32 on Intel CPUs: MKL's packed sgemm (``cblas_sgemm_pack`` through
  torch's ``_mkl_linear``), the same library as ``F.linear`` without the
  per-call repack. At 64 rows SmolLM2's matmuls take 82 instead of 108 ms a
  step, at 8 rows half the time, at 2048 rows 3% less (benchmarks.md). One-
  and two-row calls keep ``F.linear``, which is as fast there.
- float32 elsewhere: MKL takes a generic path on other vendors' CPUs: on an
  AMD EPYC (AVX-512) SmolLM2's matmuls took 146 ms a step at 64 rows with
  ``F.linear``, 176 with MKL's packed call and 93 with oneDNN's blocked
  layout (as vLLM's CPU backend uses); at one row 23 and 9 ms. Where the CPU
  has AVX-512 or AVX2 with FMA, fma_linear_f32.py's kernel streams each
  weight once per call instead, at every row count: on the same EPYC, with
  weights cold from memory as in a step, 53-54 against 55-57 ms at 64 rows,
  14 against 18 at one; with one layer's weights warm, 37 against 39 ms for
  a layer's matmuls at 2048 rows (prefill). On an AVX2-only EPYC, a step's
  matmuls (with the LM head) 160-170 against 193-202 ms at 64 rows, 40-44
  against 58-64 at one. Elsewhere, oneDNN's layout.

Packed float32 calls block the sums differently from the unpacked one for
some shapes and row counts, so an output may differ from ``F.linear``'s in
the last bits (up to ~1e-4 on outputs of ~20), as vLLM's oneDNN path does.

The copy doubles the memory of the weights it serves. Other devices keep
``F.linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.dtypes import cpu_is_intel
from engine.layers import amx_linear, avx512_linear, fma_linear_f32

# Float32 calls with fewer rows keep F.linear where MKL packs (no faster there).
MKL_MIN_ROWS = 3


# Which library packs float32 weights: MKL on Intel CPUs, oneDNN elsewhere.
FP32_MKL = cpu_is_intel()


@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU: it refuses to
    without AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only CPU), and then
    bfloat16 layers keep ``F.linear``."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.dtype == torch.bfloat16:
        backend = _onednn_bf16()
    elif x.dtype == torch.float32:
        backend = (torch.backends.mkl if FP32_MKL else torch.backends.mkldnn).is_available()
    else:
        return False
    return (x.device.type == "cpu" and weight.dtype == x.dtype and weight.dim() == 2 and backend
            # NOTE: an inference tensor has no version counter, so writes to
            # it could not be seen: it keeps F.linear.
            and not weight.is_inference()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _decode_kernel():
    """The bf16 decode matmul this CPU runs: AMX tiles, else AVX512-BF16 dot
    products (both read amx_linear's layout), else None (oneDNN)."""
    if amx_linear.available():
        return amx_linear
    if avx512_linear.available():
        return avx512_linear
    return None


def _f32_kernel():
    """The float32 matmul this CPU runs from its own layout where MKL is not
    used: fma_linear_f32 with AVX-512 or AVX2 and FMA, else None (oneDNN)."""
    return fma_linear_f32 if fma_linear_f32.available() else None


class PackedWeight:
    """One weight's packed copy, for ``linear(x, weight)``. bfloat16: the
    bf16-pairs layout where a decode kernel runs and the shape fits, then
    decode-sized batches take that kernel and larger ones ``F.linear``; else
    oneDNN's blocked layout. float32: MKL's layout on Intel CPUs, else
    fma_linear_f32's where it runs and the shape fits, else oneDNN's."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None
        # The kernel of the packed layout: for bf16 decodes amx_linear or
        # avx512_linear, for float32 fma_linear_f32; or None (oneDNN / MKL).
        self._kernel = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, from the packed copy where that pays."""
        if not _packable(x, weight):
            return F.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        if x.dtype == torch.float32 and FP32_MKL and flat.shape[0] < MKL_MIN_ROWS:
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version)
        if key != self._key:
            self._pack(weight, bias)
            self._key = key
        if x.dtype == torch.float32 and FP32_MKL:
            rows = flat.shape[0]
            y = torch.ops.mkl._mkl_linear(flat, self._packed, weight, bias, rows)
        elif self._kernel is fma_linear_f32:
            y = fma_linear_f32.linear(flat, self._packed, weight.shape[0], bias)
        elif self._kernel is None:
            y = torch.ops.mkldnn._linear_pointwise(flat, self._packed, bias, "none", [], "")
        elif flat.shape[0] <= self._kernel.MAX_ROWS:
            y = self._kernel.linear(flat, self._packed, weight.shape[0],
                                    None if bias is None else bias.contiguous())
        else:
            return F.linear(x, weight, bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        weight = weight.detach()
        self._kernel = None
        if weight.dtype == torch.float32:
            if FP32_MKL:
                # The row count is MKL's blocking hint: 512 serves decode and prefill alike.
                self._packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 512)
            elif (_f32_kernel() is not None and fma_linear_f32.fits(weight)
                  and (bias is None or bias.dtype == weight.dtype)):
                self._kernel = fma_linear_f32
                self._packed = fma_linear_f32.pack(weight)
            else:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            return
        if amx_linear.fits(weight) and (bias is None or bias.dtype == weight.dtype):
            self._kernel = _decode_kernel()
        self._packed = (amx_linear.pack(weight) if self._kernel is not None
                        else torch.ops.mkldnn._reorder_linear_weight(weight))


class Linear(torch.nn.Linear):
    """``nn.Linear`` whose bfloat16 and float32 CPU forward uses a ``PackedWeight``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.linear(x, self.weight, self.bias)
