"""bfloat16 matmuls on the CPU with the weight prepacked.

``F.linear`` in bfloat16 on the CPU runs oneDNN's AMX / AVX512-BF16 matmul,
but with a plain ``[out, in]`` weight it reorders the whole weight into the
blocked layout those instructions need on every call: for decode-sized
batches that reorder costs about as much as the matmul. ``PackedWeight``
keeps a packed copy, made on first use and again whenever the weight is
replaced or written (its data pointer or version counter changes): the AMX
tile layout of amx_linear.py where that kernel runs (decode-sized batches go
through it, larger ones through ``F.linear``, whose reorder is small beside
their compute), else oneDNN's own layout (the same outputs as ``F.linear``).
The AMX kernel accumulates in float32 in its own order, so its bfloat16
outputs may differ from ``F.linear``'s by one rounding.

The copy doubles the memory of the bf16 weights it serves. Float32 and
other devices keep ``F.linear``: float32 runs MKL's sgemm, the kernel
Hugging Face's float32 outputs come from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers import amx_linear


def _packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.dtype == x.dtype
            and weight.dim() == 2 and torch.backends.mkldnn.is_available()
            # NOTE: an inference tensor has no version counter, so writes to
            # it could not be seen: it keeps F.linear.
            and not weight.is_inference()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


class PackedWeight:
    """One weight's packed copy, for ``linear(x, weight)``: AMX tiles
    (amx_linear.py) where the CPU has them and the shape fits, then decode-
    sized batches take that kernel and larger ones ``F.linear``; else
    oneDNN's blocked layout."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None
        self._amx = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, from the packed copy where that pays."""
        if not _packable(x, weight):
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version)
        if key != self._key:
            self._amx = (amx_linear.available() and amx_linear.fits(weight)
                         and (bias is None or bias.dtype == weight.dtype))
            self._packed = (amx_linear.pack(weight) if self._amx
                            else torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
            self._key = key
        flat = x.reshape(-1, x.shape[-1])
        if not self._amx:
            y = torch.ops.mkldnn._linear_pointwise(flat, self._packed, bias, "none", [], "")
        elif flat.shape[0] <= amx_linear.MAX_ROWS:
            y = amx_linear.linear(flat, self._packed, weight.shape[0],
                                  None if bias is None else bias.contiguous())
        else:
            return F.linear(x, weight, bias)
        return y.view(*x.shape[:-1], y.shape[-1])


class Linear(torch.nn.Linear):
    """``nn.Linear`` whose bfloat16 CPU forward uses a ``PackedWeight``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.linear(x, self.weight, self.bias)
