"""Linear layers: plain, or with GPTQ/AWQ weight-only quantized weights.

Parameters say how a checkpoint shard fills them: ``output_dim`` is the
dimension that runs over output features (0 for ``nn.Linear``'s weight and
every bias, 1 for the quantized ``[in, out]`` tensors, None for ``g_idx``,
which is per input row); ``optional`` ones may be absent from a checkpoint;
``tp_dim`` is the dimension of the checkpoint tensor that tensor-parallel
ranks split between them (absent: every rank holds all of it).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quantization import QuantConfig
from engine.quantization.formats import to_tandem
from kernels import reference


def linear(
    in_features: int, out_features: int, bias: bool, quant: QuantConfig | None, fused: bool,
    parallel: str | None = None,
) -> nn.Module:
    """A linear layer of this rank's shape. ``parallel``: "column" when ranks
    split its outputs (each holds some rows of the weight), "row" when they
    split its inputs (each holds some columns; the caller sums the partial
    outputs across ranks), None when every rank holds all of it."""
    if quant is None:
        layer = nn.Linear(in_features, out_features, bias=bias)
        if parallel is not None:
            layer.weight.tp_dim = 0 if parallel == "column" else 1
            if layer.bias is not None and parallel == "column":
                layer.bias.tp_dim = 0
        return layer
    if parallel is not None:
        raise ValueError("tensor parallelism is not supported with quantized checkpoints yet")
    return QuantLinear(in_features, out_features, bias, quant, fused)


class QuantLinear(nn.Module):
    """``y = x @ W + b`` with ``W`` as packed integers, per-group scales and
    zero points (the layout of engine/quantization/formats.py)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, quant: QuantConfig, fused: bool
    ) -> None:
        super().__init__()
        group, pack = quant.group_of(in_features), quant.pack_factor
        if in_features % group or in_features % pack or out_features % pack:
            raise ValueError(
                f"a {in_features}x{out_features} layer cannot hold {quant.method} "
                f"{quant.bits}-bit weights in groups of {group}: the input size must be a "
                f"multiple of the group size and of {pack}, the output size of {pack}"
            )
        self.quant = quant
        groups = in_features // group

        def param(t: torch.Tensor, output_dim: int | None) -> nn.Parameter:
            p = nn.Parameter(t, requires_grad=False)
            p.output_dim = output_dim
            return p

        self.qweight = param(torch.zeros(in_features // pack, out_features, dtype=torch.int32), 1)
        self.scales = param(torch.ones(groups, out_features), 1)
        self.zeros = param(torch.zeros(groups, out_features), 1)
        self.g_idx = param(torch.arange(in_features, dtype=torch.int32) // group, None)
        self.g_idx.optional = True  # AWQ stores none; GPTQ's may be the default order
        self.bias = param(torch.zeros(out_features), 0) if bias else None
        if fused:
            from kernels.quant_matmul import quant_matmul  # imports triton: only where it runs

            self._matmul = quant_matmul
        else:
            self._matmul = reference.quant_matmul

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """A checkpoint tensor of this layer -> (parameter name, value)."""
        return to_tandem(self.quant, name, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.qweight, self.scales, self.zeros, self.g_idx, self.quant.bits)
        return y if self.bias is None else y + self.bias
