"""A linear layer with 8-bit weights and per-row scales (compressed-tensors
FP8/INT8, and ``quantization="fp8"`` at load): engine/quantization/compressed.py
says the format.

On the CPU the forward is the torch reference: the weight is dequantized on
every call (``weight * weight_scale`` in float32, then the input's dtype).
That is exact to the format and costs a dequantization per call
(benchmarks/scaled_linear_cpu.py measures it); the memory saved is the
weights' at rest. INT8 weights under bfloat16 inputs of a few rows (decode)
instead take torch's int8 weight-only GEMV, which reads the 8-bit weight
once and beats even a bfloat16 ``F.linear`` there. With fused layers (the Triton backend, on CUDA) the matmul
is ``kernels.scaled_matmul``, which reads the 8-bit weights as they are. For
a W8A8 scheme either path first quantizes the input and scales it back, the
way an 8-bit matmul would see it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization.compressed import (
    dequantize_weight,
    fake_quantize_input,
    quantize_weight,
    weight_dtype,
)
from engine.quantization.compressed_config import CompressedConfig

# torch's CPU int8 GEMV costs one pass over the weight per input row, so past
# this many rows dequantizing once and multiplying is cheaper (measured on
# SmolLM2's shapes: docs/benchmarks.md).
INT8_GEMV_MAX_ROWS = 32


class ScaledLinear(nn.Module):
    """``y = x @ (weight * weight_scale[:, None]).T + b``; ``weight`` ``[out, in]``.

    Tensor parallelism splits ``weight`` like ``nn.Linear``'s; a column-split
    layer splits its scales too, a row-split one keeps them all (each rank
    holds every output row).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: CompressedConfig,
                 parallel: str | None = None, fused: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self._kernel = None
        if fused:
            from kernels.scaled_matmul import scaled_matmul  # imports triton: only where it runs

            self._kernel = scaled_matmul
        column = parallel == "column"

        def param(t: torch.Tensor, tp_dim: int | None) -> nn.Parameter:
            p = nn.Parameter(t, requires_grad=False)
            p.output_dim = 0
            if parallel is not None and tp_dim is not None:
                p.tp_dim = tp_dim
            return p

        # Online quantization loads the float weight first (finish_loading quantizes it).
        dtype = torch.get_default_dtype() if cfg.online else weight_dtype(cfg)
        self.weight = param(torch.zeros(out_features, in_features, dtype=dtype),
                            0 if column else 1)
        self.weight_scale = param(torch.ones(out_features, dtype=torch.float32),
                                  0 if column else None)
        self.weight_scale.broadcast_scalar = True  # a per-tensor scale fills its shard's rows
        self.weight_scale.optional = cfg.online
        self.bias = param(torch.zeros(out_features), 0) if bias else None
        # NOTE: torch._weight_int8pack_mm is a private op; with in_features not
        # a multiple of 16 it returns garbage or crashes, so ask for 32.
        self._int8_gemv = (not fused and cfg.weight_type == "int" and in_features % 32 == 0
                           and hasattr(torch, "_weight_int8pack_mm"))

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """A checkpoint tensor of this layer -> (parameter name, value)."""
        if name == "weight_scale":
            return name, tensor.float().reshape(-1)
        if name == "weight":
            want = self.weight.dtype
            if not self.cfg.online and tensor.dtype != want:
                raise ValueError(f"a {self.cfg.scheme} weight must be {want}, got {tensor.dtype} "
                                 "(a float checkpoint under a quantization_config?)")
            return name, tensor
        if name == "bias":
            return name, tensor
        raise ValueError(f"{name!r} is not a tensor of a {self.cfg.scheme} linear layer "
                         "(static input scales and zero points are not supported)")

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Quantize a float weight loaded for ``quantization="fp8"``."""
        if not self.cfg.online or self.weight.dtype == weight_dtype(self.cfg):
            return
        q, scale = quantize_weight(self.weight.data, self.cfg)
        self.weight.data = q
        self.weight_scale.data = scale.reshape(-1).to(self.weight_scale.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.activations is not None:
            x = fake_quantize_input(x, self.cfg)
        if self._kernel is not None:
            y = self._kernel(x, self.weight, self.weight_scale)
        elif (self._int8_gemv and x.is_cpu and x.dtype == torch.bfloat16 and x.dim() == 2
              and x.shape[0] <= INT8_GEMV_MAX_ROWS):
            # The sum is float32 over the exact integers; the scale is rounded
            # to bfloat16 (the op's contract), about the output's own rounding.
            y = torch._weight_int8pack_mm(x.contiguous(), self.weight,
                                          self.weight_scale.to(torch.bfloat16))
        else:
            w = dequantize_weight(self.weight, self.weight_scale).to(x.dtype)
            return F.linear(x, w, self.bias)
        return y if self.bias is None else y + self.bias
