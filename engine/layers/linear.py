"""Linear layers: plain, or with GPTQ/AWQ/compressed-tensors pack-quantized
weight-only integer weights.

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

from engine.layers.packed import Linear
from engine.layers.scaled_linear import ScaledLinear
from engine.parallel import TensorParallel
from engine.quantization import QuantConfig, packed
from engine.quantization.compressed_config import CompressedConfig
from engine.quantization.config import PACKED_METHOD
from engine.quantization.formats import to_tandem
from kernels import reference


def linear(
    in_features: int, out_features: int, bias: bool,
    quant: QuantConfig | CompressedConfig | None, fused: bool,
    tp: TensorParallel | None = None, parallel: str | None = None,
) -> nn.Module:
    """This rank's part of an ``in_features`` -> ``out_features`` layer.

    ``parallel``: "column" when tensor-parallel ranks split its outputs (each
    holds some rows of the weight), "row" when they split its inputs (each
    holds some columns and the caller sums the ranks' partial outputs), None
    when every rank holds all of it.
    """
    size, rank = (tp.size, tp.rank) if tp is not None and parallel else (1, 0)
    if parallel == "row" and bias:
        raise ValueError("a row-parallel layer cannot have a bias: every rank would add it")
    local_in = in_features // size if parallel == "row" else in_features
    local_out = out_features // size if parallel == "column" else out_features
    if isinstance(quant, CompressedConfig):  # 8-bit weights with per-row scales
        return ScaledLinear(local_in, local_out, bias, quant, parallel, fused)
    if quant is None:
        layer = Linear(local_in, local_out, bias=bias)
        if parallel is not None:
            layer.weight.tp_dim = 0 if parallel == "column" else 1
            if layer.bias is not None:
                layer.bias.tp_dim = 0
        return layer
    return QuantLinear(local_in, local_out, bias, quant, fused, parallel=parallel, rank=rank,
                       full_in_features=in_features)


class QuantLinear(nn.Module):
    """``y = x @ W + b`` with ``W`` as packed integers, per-group scales and
    zero points (the layout of engine/quantization/formats.py).

    Split by rows (inputs) across ranks, each rank keeps every group's scales
    and zero points and its slice of ``g_idx``, which indexes them: that
    serves act-order checkpoints, whose groups are scattered over the rows.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, quant: QuantConfig, fused: bool,
        *, parallel: str | None = None, rank: int = 0, full_in_features: int | None = None,
    ) -> None:
        super().__init__()
        full_in = full_in_features or in_features
        group, pack = quant.group_of(full_in), quant.pack_factor
        if full_in % group or in_features % pack:
            raise ValueError(
                f"a layer of {full_in} inputs ({in_features} on this rank) cannot hold "
                f"{quant.method} {quant.bits}-bit weights in groups of {group}: the input size "
                f"must be a multiple of the group size, and each rank's of {pack}"
            )
        self.quant, self.full_in_features = quant, full_in
        groups = full_in // group
        column, row = parallel == "column", parallel == "row"

        def param(t: torch.Tensor, output_dim: int | None, tp_dim: int | None) -> nn.Parameter:
            p = nn.Parameter(t, requires_grad=False)
            p.output_dim = output_dim
            if parallel is not None and tp_dim is not None:
                p.tp_dim = tp_dim
            return p

        self.qweight = param(torch.zeros(in_features // pack, out_features, dtype=torch.int32), 1,
                             1 if column else 0)
        self.scales = param(torch.ones(groups, out_features), 1, 1 if column else None)
        # Symmetric compressed-tensors weights store no zero points: all sit at the offset.
        self.zeros = param(torch.full((groups, out_features), float(quant.zero_offset)), 1,
                           1 if column else None)
        self.zeros.optional = not quant.stored_zeros
        first_row = rank * in_features if row else 0
        rows = torch.arange(first_row, first_row + in_features, dtype=torch.int32)
        self.g_idx = param(rows // group, None, 0 if row else None)
        self.g_idx.optional = True  # AWQ stores none; GPTQ's may be the default order
        self.bias = param(torch.zeros(out_features), 0, 0) if bias else None
        self._fused = fused
        # How many aligned rows g_idx keeps in one group (kernels.quant_matmul):
        # read once from the loaded weights, at the first forward (a warm-up, never
        # inside a CUDA graph capture).
        self._uniform_rows: int | None = None
        if fused:
            from kernels.quant_matmul import quant_matmul  # imports triton: only where it runs

            self._matmul = quant_matmul
        else:
            self._matmul = reference.quant_matmul

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor
                          ) -> tuple[str, torch.Tensor] | None:
        """A checkpoint tensor of this layer -> (parameter name, value), or
        None for one that is only checked (compressed-tensors' weight_shape)."""
        if self.quant.method != PACKED_METHOD:
            return to_tandem(self.quant, name, tensor)
        if name == "weight_shape":
            if tensor.numel() != 2 or int(tensor[1]) != self.full_in_features:
                raise ValueError(f"weight_shape {tensor.tolist()} does not match a layer of "
                                 f"{self.full_in_features} inputs")
            return None
        return packed.to_tandem(self.quant, name, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused:
            if self._uniform_rows is None:
                from kernels.quant_matmul import uniform_group_rows

                self._uniform_rows = uniform_group_rows(self.g_idx)
            y = self._matmul(x, self.qweight, self.scales, self.zeros, self.g_idx,
                             self.quant.bits, uniform_rows=self._uniform_rows)
        else:
            y = self._matmul(x, self.qweight, self.scales, self.zeros, self.g_idx,
                             self.quant.bits)
        return y if self.bias is None else y + self.bias
