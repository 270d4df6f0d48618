"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import cpu_ops
from kernels import reference


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        if fused:  # one Triton kernel for the add and the norm
            from kernels.rms_norm import rms_norm  # imports triton: only where it runs

            self._rms_norm = rms_norm
        else:
            self._rms_norm = reference.rms_norm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(norm(x + residual), x + residual)``."""
        if self._rms_norm is reference.rms_norm and x.dim() == 2 and cpu_ops.supports(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        return self._rms_norm(x, self.weight, self.eps, residual)
