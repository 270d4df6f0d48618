"""The C signature the CPU linear kernels share, from Python.

amx_linear.py, avx512_linear.py and fma_linear_f32.py each build a library
whose matmul is ``int f(y, y_stride, x, x_stride, packed, bias, rows, k, n)``
(0, or -1 for shapes it refuses). ``load`` builds and types one;
``run_packed`` calls one on torch tensors.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from engine.attention import cbuild

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def load(name: str, source: str, symbol: str,
         usable: Callable[[ctypes.CDLL], bool]) -> ctypes.CDLL | None:
    """The library built from ``source`` with ``symbol`` typed as the shared
    signature, or None where it did not build or ``usable(lib)`` says this
    CPU cannot run it."""
    lib = cbuild.load(name, source)
    if lib is None or not usable(lib):
        return None
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64]
    return lib


def run_packed(fn, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None, name: str) -> torch.Tensor:
    """``y = fn(y, y_stride, x, x_stride, packed, bias, rows, k, n)`` for a
    2-D ``x``; ``y`` in ``x``'s dtype. ValueError when the kernel refuses
    the shapes."""
    rows, in_features = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(rows, out_features, dtype=x.dtype)
    rc = fn(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), packed.data_ptr(),
            None if bias is None else bias.data_ptr(), rows, in_features, out_features)
    if rc != 0:
        raise ValueError(f"{name} cannot multiply {tuple(x.shape)} by a weight of "
                         f"{out_features} outputs")
    return y
