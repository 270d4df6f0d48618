"""GPTQ and AWQ checkpoint tensors, and the one layout Tandem computes with.

Both formats store a linear layer ``y = x @ W`` (``W`` is ``[in, out]``) as
``bits``-bit integers ``q``, with per-group scales ``s`` and zero points
``z``: ``W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]``. They pack the
integers into int32 words differently:

* GPTQ: ``qweight`` ``[in / pack, out]``, word ``r`` holding rows
  ``r * pack ..`` in order from the low bits; ``qzeros`` ``[groups, out / pack]``
  packed the same way along the columns, each stored as zero - 1 in the
  original format; ``g_idx`` ``[in]`` names each row's group (act-order
  checkpoints permute it).
* AWQ (GEMM): ``qweight`` ``[in, out / 8]`` and ``qzeros`` ``[groups, out / 8]``,
  both packed along the columns in the interleaved order ``AWQ_ORDER``;
  groups are consecutive rows.

Tandem's layout (``QuantLinear``'s parameters) is GPTQ's ``qweight``, plus
unpacked zero points in the model's dtype and an explicit ``g_idx``, so one
kernel and one reference serve both. Each checkpoint tensor converts on its
own, column by column, so fused q/k/v and gate/up layers load shard by shard.
"""

from __future__ import annotations

import torch

from engine.quantization.config import QuantConfig
from kernels.reference import unpack_int_rows

# Nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight columns.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j sits in nibble _AWQ_UNDO[j]


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``kernels.reference.unpack_int_rows``: ``[K, C]`` -> ``[K / pack, C]`` int32."""
    pack = 32 // bits
    if values.shape[0] % pack:
        raise ValueError(f"{values.shape[0]} values do not pack into words of {pack}")
    v = values.to(torch.int64).reshape(-1, pack, values.shape[1])
    return _to_int32((v << _shifts(bits, v.device).long()[None, :, None]).sum(1))


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, C]`` int32 -> ``[R, C * pack]``: the same words, packed along the columns."""
    return unpack_int_rows(packed.T, bits).T


def pack_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``unpack_cols``: ``[R, N]`` -> ``[R, N / pack]`` int32."""
    return pack_rows(values.T, bits).T.contiguous()


def _awq_columns(n: int, device: torch.device) -> torch.Tensor:
    """Index that puts the columns of an unpacked AWQ tensor back in order."""
    base = torch.arange(0, n, 8, device=device)[:, None]
    return (base + torch.tensor(_AWQ_UNDO, device=device)[None, :]).reshape(-1)


def to_tandem(quant: QuantConfig, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One checkpoint tensor of a quantized linear layer (``qweight``,
    ``qzeros``, ``scales``, ``g_idx`` or ``bias``) -> the name and value of
    the QuantLinear parameter it fills."""
    if name in ("scales", "bias"):
        return name, tensor
    if name == "g_idx":
        return name, tensor.to(torch.int32)
    if name not in ("qweight", "qzeros"):
        raise ValueError(
            f"{name!r} is not a tensor of a {quant.method} linear layer "
            f"(a float checkpoint under a quantization_config?)"
        )
    if tensor.dtype != torch.int32:
        raise ValueError(f"{quant.method} {name} must be int32, got {tensor.dtype}")
    bits = quant.bits
    if name == "qzeros":
        zeros = unpack_cols(tensor, bits)
        if quant.method == "awq":
            zeros = zeros[:, _awq_columns(zeros.shape[1], zeros.device)]
        return "zeros", zeros + quant.zero_offset
    if quant.method == "gptq":
        return name, tensor
    values = unpack_cols(tensor, bits)  # AWQ's qweight
    return name, pack_rows(values[:, _awq_columns(values.shape[1], values.device)], bits)


# ---- writing checkpoints: tests, benchmarks, and quantizing a model by hand ----


def quantize_rtn(
    weight: torch.Tensor, bits: int, group_size: int, g_idx: torch.Tensor | None = None,
    min_zero: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest, asymmetric min/max quantization of an ``nn.Linear``
    weight ``[out, in]``. Returns ``(q [in, out], scales [groups, out],
    zeros [groups, out] (integers >= min_zero), g_idx [in])``."""
    w = weight.T.float()  # [in, out]
    k = w.shape[0]
    group = k if group_size == -1 else group_size
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group}")
    if g_idx is None:
        g_idx = torch.arange(k, dtype=torch.int32) // group
    num_groups, maxq = k // group, (1 << bits) - 1
    lo = torch.stack([w[g_idx == g].amin(0) for g in range(num_groups)]).clamp(max=0)
    hi = torch.stack([w[g_idx == g].amax(0) for g in range(num_groups)]).clamp(min=0)
    scales = ((hi - lo) / maxq).clamp(min=1e-8)
    zeros = torch.round(-lo / scales)
    # A zero below min_zero moves up to it; the range then spans fewer steps.
    low = zeros < min_zero
    scales = torch.where(low, ((hi - lo) / (maxq - min_zero)).clamp(min=1e-8), scales)
    zeros = torch.where(low, torch.full_like(zeros, min_zero), zeros).clamp(max=maxq)
    q = torch.clamp(torch.round(w / scales[g_idx]) + zeros[g_idx], 0, maxq).to(torch.int32)
    return q, scales, zeros.to(torch.int32), g_idx


def checkpoint_tensors(
    quant: QuantConfig, weight: torch.Tensor, g_idx: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """An ``nn.Linear`` weight quantized and packed as ``quant.method`` stores
    it (scales in float16, as both tools write them)."""
    bits = quant.bits
    # GPTQ's original format stores zero - 1 in ``bits`` bits, so a zero of 0
    # cannot be written: such checkpoints keep zeros >= 1.
    q, scales, zeros, g_idx = quantize_rtn(weight, bits, quant.group_size, g_idx,
                                           min_zero=quant.zero_offset)
    if quant.method == "gptq":
        return {"qweight": pack_rows(q, bits), "qzeros": pack_cols(zeros - quant.zero_offset, bits),
                "scales": scales.half(), "g_idx": g_idx}
    order = torch.tensor(AWQ_ORDER)
    interleave = (torch.arange(0, q.shape[1], 8)[:, None] + order[None, :]).reshape(-1)
    return {"qweight": pack_cols(q[:, interleave], bits),
            "qzeros": pack_cols(zeros[:, interleave], bits), "scales": scales.half()}
