"""8-bit weights with scales: ``compressed-tensors`` checkpoints (what
llm-compressor writes) and ``quantization="fp8"`` of a float model at load.

A checkpoint's config.json says ``"quant_method": "compressed-tensors"`` and
describes its scheme in ``config_groups``: one group targeting ``Linear``
whose ``weights`` are 8-bit ``float`` (e4m3) or ``int``, symmetric, with a
``tensor`` (one scale per layer) or ``channel`` (one per output row)
``strategy``; ``input_activations`` is null (weight-only: W8A16) or dynamic
(W8A8: each call quantizes its input per ``token`` or per ``tensor``).
Each linear layer stores ``weight`` ``[out, in]`` in float8_e4m3fn or int8
and ``weight_scale`` (``[1]`` per tensor, ``[out, 1]`` per channel):
``W = weight * weight_scale``. The formats read are ``float-quantized``,
``int-quantized`` and ``naive-quantized`` (integers as int8 tensors);
static activation scales, zero points and groups are refused at start with a
message. ``pack-quantized`` checkpoints (4- or 8-bit integers in int32 words,
llm-compressor's WnA16) are another layer's: engine/quantization/packed.py.

Tandem computes with per-row scales: a per-tensor scale fills the rows of its
layer (each shard of a fused q/k/v or gate/up layer keeps its own).
"""

from __future__ import annotations

import torch

from engine.quantization.compressed_config import CompressedConfig
from kernels.reference import dequantize_kv

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def weight_dtype(cfg: CompressedConfig) -> torch.dtype:
    return torch.float8_e4m3fn if cfg.weight_type == "float" else torch.int8


def quantize_weight(weight: torch.Tensor, cfg: CompressedConfig
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``nn.Linear`` weight ``[out, in]`` -> ``(q [out, in], scale)``:
    symmetric, absmax, scale ``[out, 1]`` per channel or ``[1]`` per tensor,
    in float32."""
    w = weight.float()
    top = w.abs().amax(dim=1, keepdim=True) if cfg.strategy == "channel" else w.abs().amax()
    limit = FP8_MAX if cfg.weight_type == "float" else 127.0
    scale = (top / limit).clamp(min=1e-12)
    if cfg.strategy == "tensor":
        scale = scale.reshape(1)
    if cfg.weight_type == "float":
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in float32; ``scale`` per row (``[out]`` or ``[out, 1]``) or one."""
    s = scale.float()
    # dequantize_kv widens e4m3 through float16 bits: exact, and faster on the CPU.
    qf = dequantize_kv(q) if q.dtype == torch.float8_e4m3fn else q.float()
    return qf * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))


def fake_quantize_input(x: torch.Tensor, cfg: CompressedConfig) -> torch.Tensor:
    """A W8A8 layer's input as the 8-bit matmul sees it: quantized with a
    dynamic absmax scale per token (row) or per tensor, and scaled back."""
    xf = x.float()
    top = xf.abs().amax(dim=-1, keepdim=True) if cfg.activations == "token" else xf.abs().amax()
    if cfg.weight_type == "float":
        scale = (top / FP8_MAX).clamp(min=1e-12)
        q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        scale = (top / 127.0).clamp(min=1e-12)
        q = torch.round(xf / scale).clamp(-128, 127)
    return (q * scale).to(x.dtype)


def checkpoint_tensors(cfg: CompressedConfig, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """An ``nn.Linear`` weight as a compressed-tensors checkpoint stores it."""
    q, scale = quantize_weight(weight, cfg)
    return {"weight": q, "weight_scale": scale}
