"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from kernels import reference


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(norm(x + residual), x + residual)``."""
        return reference.rms_norm(x, self.weight, self.eps, residual)
