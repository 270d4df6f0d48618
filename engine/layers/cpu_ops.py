"""RMSNorm, rotary and SiLU-and-mul for CPU tensors in one C pass each.

kernels/reference.py computes each in float32 from the model's dtype with
a dozen small torch ops (converts, adds, pows, means, muls, a cat and a
convert back), each a pass over the activations and, at decode sizes, most
of it dispatch. These C loops do each whole layer op in one pass, with the
same float32 operations in the same order per element and, in bfloat16, the
same round-to-nearest-even back; built with ``-ffp-contract=off`` so that
no multiply-add is fused where torch rounds twice. Rotary is therefore
bit-identical to the reference; RMSNorm sums each row's squares in its own
order, so its float32 mean of squares may differ from torch's in the last
bit; SiLU's exp is this file's polynomial, within an ulp or two of torch's.

bfloat16 and float32 (``supports``); the argmax is bfloat16's only. The C
source is in c_ops.py.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.attention import cbuild
from engine.attention.c_prelude import VECTOR_MATH
from engine.layers import c_ops

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _lib():
    lib = cbuild.load("cpu_ops", VECTOR_MATH + c_ops.SOURCE, extra_flags=("-ffp-contract=off",))
    if lib is None:
        return None
    for suffix in ("bf16", "f32"):
        rms, silu, rotary = (getattr(lib, f"{name}_{suffix}")
                             for name in ("rms_norm", "silu_mul", "rotary"))
        rms.restype = silu.restype = rotary.restype = None
        rms.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_float]
        silu.argtypes = [_PTR, _PTR, _I64, _I64, _I64]
        rotary.argtypes = [_PTR, _I64, _I64, ctypes.c_int, _PTR, _I64, _I64, ctypes.c_int,
                           _PTR, _PTR, _PTR, _I64, ctypes.c_int]
    lib.argmax_bf16.restype = None
    lib.argmax_bf16.argtypes = [_PTR, _PTR, _I64, _I64, _I64]
    return lib


_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _kernel(name: str, dtype: torch.dtype):
    return getattr(_lib(), f"{name}_{_SUFFIX[dtype]}")


def supports(x: torch.Tensor) -> bool:
    """Whether these kernels serve ``x`` (bfloat16 or float32 on the CPU, rows
    with unit stride)."""
    return (x.device.type == "cpu" and x.dtype in _SUFFIX and x.stride(-1) == 1
            and _lib() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.rms_norm`` for 2-D ``x`` (check ``supports``)."""
    rows, cols = x.shape
    if weight.shape != (cols,) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{cols}] {x.dtype} tensor")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1):
        raise ValueError("residual must match x in shape and dtype, with unit last stride")
    out = torch.empty((rows, cols), dtype=x.dtype)
    new_residual = torch.empty((rows, cols), dtype=x.dtype)
    _kernel("rms_norm", x.dtype)(
        out.data_ptr(), new_residual.data_ptr(), x.data_ptr(),
        None if residual is None else residual.data_ptr(), weight.data_ptr(), rows, cols,
        x.stride(0), 0 if residual is None else residual.stride(0), eps,
    )
    return out, new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for 2-D ``x = [gate | up]`` (check ``supports``).
    SiLU's exp is this file's polynomial, not torch's, so an output may differ
    from torch's in the last bit (bfloat16: by one ulp where that rounds apart)."""
    rows, width = x.shape
    out = torch.empty((rows, width // 2), dtype=x.dtype)
    _kernel("silu_mul", x.dtype)(out.data_ptr(), x.data_ptr(), rows, width // 2, x.stride(0))
    return out


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """``reference.apply_rotary`` of q ``[tokens, heads, dim]`` and k ``[tokens,
    kv_heads, dim]`` in place, with the rows of float32 ``cos``/``sin``
    ``[max_position, dim / 2]`` at ``positions`` (check ``supports`` for both)."""
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or k.dtype != q.dtype:
        raise ValueError("q and k need the same tokens, head_dim and dtype")
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos and sin must be contiguous float32 tables")
    pos = positions.to(torch.int64).contiguous()
    _kernel("rotary", q.dtype)(
        q.data_ptr(), q.stride(0), q.stride(1), q.shape[1],
        k.data_ptr(), k.stride(0), k.stride(1), k.shape[1],
        pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), num_tokens, head_dim,
    )


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.float().argmax(-1)`` for 2-D bfloat16 ``logits`` (check
    ``supports``), without the float32 copy: one pass over the rows."""
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    _lib().argmax_bf16(out.data_ptr(), logits.data_ptr(), rows, cols, logits.stride(0))
    return out
