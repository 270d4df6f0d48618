"""compressed-tensors ``pack-quantized`` weights (what llm-compressor writes
for W4A16 and W8A16), and how they load into Tandem's integer layout.

A linear layer ``[out, in]`` of ``bits``-bit integers (``pack = 32 / bits``
per int32 word) is stored as:

* ``weight_packed`` ``[out, in / pack]`` int32: word ``j`` of row ``o`` holds
  inputs ``j * pack ..`` from the low bits up, each as ``q + 2**(bits-1)``,
  the unsigned form of a signed integer ``q`` in ``[-2**(bits-1), 2**(bits-1))``;
* ``weight_scale`` ``[out, groups]``: one group per row (``channel`` strategy)
  or one per ``group_size`` consecutive inputs (``group``);
* ``weight_zero_point`` ``[out / pack, groups]`` int32, asymmetric weights
  only: the signed zero points, offset and packed the same way but down the
  output rows; absent, every zero point is 0;
* ``weight_g_idx`` ``[in]``, act-order checkpoints only: each input's group;
* ``weight_shape`` ``[2]``: ``(out, in)``, which the packed words already say
  (Tandem needs ``in`` a multiple of ``pack``: no padded words).

``W[o, k] = (q[o, k] - z[o, g(k)]) * s[o, g(k)]``.

The offset makes the words exactly Tandem's (GPTQ's) unsigned layout,
transposed: ``qweight = weight_packed.T``, with zero points raised by
``2**(bits-1)`` (``QuantConfig.zero_offset``). So QuantLinear, its torch
reference, its Triton kernel and its tensor-parallel split serve these
checkpoints as they are.
"""

from __future__ import annotations

import torch

from engine.quantization.config import QuantConfig
from engine.quantization.formats import pack_cols, pack_rows
from kernels.reference import unpack_int_rows


def to_tandem(quant: QuantConfig, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One checkpoint tensor of a pack-quantized linear layer -> the name and
    value of the QuantLinear parameter it fills (``weight_shape`` is checked
    by the layer itself)."""
    if name == "weight_packed":
        if tensor.dtype != torch.int32:
            raise ValueError(f"weight_packed must be int32, got {tensor.dtype}")
        return "qweight", tensor.T.contiguous()
    if name == "weight_scale":
        return "scales", tensor.reshape(tensor.shape[0], -1).T.contiguous()
    if name == "weight_zero_point":
        if tensor.dtype == torch.int32:  # packed: unpacking gives zero + offset
            return "zeros", unpack_int_rows(tensor, quant.bits).T.float().contiguous()
        if tensor.dtype == torch.int8:  # one signed zero point per element
            zeros = tensor.reshape(tensor.shape[0], -1).float() + quant.zero_offset
            return "zeros", zeros.T.contiguous()
        raise ValueError(f"weight_zero_point must be int32 (packed) or int8, got {tensor.dtype}")
    if name == "weight_g_idx":
        return "g_idx", tensor.to(torch.int32)
    if name == "bias":
        return name, tensor
    raise ValueError(f"{name!r} is not a tensor of a compressed-tensors pack-quantized linear "
                     "layer (a float checkpoint under a quantization_config?)")


# ---- writing checkpoints: tandem quantize, tests --------------------------------


def quantize(
    weight: torch.Tensor, bits: int, group_size: int, symmetric: bool,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of an ``nn.Linear`` weight ``[out, in]`` -> signed
    ``q`` ``[out, in]`` (int8), ``scale`` ``[out, groups]`` in ``scale_dtype``
    and zero points ``[out, groups]`` (int8; all 0 when symmetric).

    Symmetric: the largest magnitude maps to ``2**(bits-1) - 1``. Asymmetric:
    the group's range, widened to hold 0, spans every level. Each integer is
    rounded with the scale as the file stores it, so dequantizing the file
    gives exactly the twin the tests compare against."""
    w = weight.float()
    out, k = w.shape
    group = k if group_size == -1 else group_size
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group}")
    wg = w.reshape(out, k // group, group)
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    if symmetric:
        scale = torch.maximum(-lo, hi) / qmax
    else:
        scale = (hi - lo) / (qmax - qmin)
    scale = scale.clamp(min=torch.finfo(scale_dtype).tiny).to(scale_dtype)
    s = scale.float()
    zero = torch.zeros_like(s) if symmetric else torch.round(qmin - lo / s).clamp(qmin, qmax)
    q = torch.round(wg / s[..., None] + zero[..., None]).clamp(qmin, qmax)
    return q.reshape(out, k).to(torch.int8), scale, zero.to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``(q - zero) * scale`` ``[out, in]`` in float32, per group of inputs."""
    out, k = q.shape
    groups = scale.shape[1]
    qg = q.float().reshape(out, groups, k // groups)
    return ((qg - zero.float()[..., None]) * scale.float()[..., None]).reshape(out, k)


def checkpoint_tensors(quant: QuantConfig, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """An ``nn.Linear`` weight as a pack-quantized checkpoint stores it
    (scales in the weight's dtype, as llm-compressor writes them)."""
    bits, offset = quant.bits, quant.zero_offset
    scale_dtype = weight.dtype if weight.is_floating_point() else torch.float32
    q, scale, zero = quantize(weight, bits, quant.group_size, not quant.stored_zeros, scale_dtype)
    tensors = {"weight_packed": pack_cols(q.int() + offset, bits), "weight_scale": scale,
               "weight_shape": torch.tensor(tuple(weight.shape), dtype=torch.int64)}
    if quant.stored_zeros:
        tensors["weight_zero_point"] = pack_rows(zero.int() + offset, bits)
    return tensors
