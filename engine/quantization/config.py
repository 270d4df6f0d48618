"""The ``quantization_config`` of a GPTQ or AWQ checkpoint's config.json, and
the integer weights of a compressed-tensors ``pack-quantized`` one
(engine/quantization/packed.py), which load into the same layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_METHODS = ("gptq", "awq")
# compressed-tensors' pack-quantized integers (read by compressed_config.py).
PACKED_METHOD = "compressed-tensors"


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only integer quantization, grouped along the input dimension.

    Every linear layer of the decoder (q/k/v/o, gate/up/down) holds
    ``bits``-bit integers with one scale and one zero point per group of
    ``group_size`` input rows and output column; embeddings, norms and the
    LM head stay in the model's dtype.

    ``zero_offset`` is what the checkpoint's stored zero points lack: 1 for
    GPTQ's original format (it stores zero - 1), 0 for ``gptq_v2`` and AWQ,
    ``2**(bits-1)`` for compressed-tensors, whose integers are signed.
    ``stored_zeros`` False: the checkpoint holds no zero points (symmetric
    compressed-tensors weights), every zero is ``zero_offset``.
    """

    method: str
    bits: int
    group_size: int  # -1: one group spanning the whole input
    desc_act: bool = False
    zero_offset: int = 0
    stored_zeros: bool = True

    def __post_init__(self) -> None:
        if self.method not in (*SUPPORTED_METHODS, PACKED_METHOD):
            raise ValueError(
                f"unsupported quantization method {self.method!r}; "
                f"Tandem supports {', '.join(SUPPORTED_METHODS)}"
            )
        allowed = (4,) if self.method == "awq" else (4, 8)
        if self.bits not in allowed:
            raise ValueError(
                f"{self.method} with {self.bits}-bit weights is not supported; "
                f"use {' or '.join(map(str, allowed))} bits"
            )
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"group_size must be -1 or positive, got {self.group_size}")

    @property
    def pack_factor(self) -> int:
        """Integers per packed int32 word."""
        return 32 // self.bits

    def group_of(self, in_features: int) -> int:
        """Input rows per group of a layer with ``in_features`` inputs."""
        return in_features if self.group_size == -1 else self.group_size

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> QuantConfig:
        method = str(cfg.get("quant_method", "")).lower()
        if method == "awq":
            version = str(cfg.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"AWQ version {version!r} is not supported; use 'gemm'")
            if not cfg.get("zero_point", True):
                raise ValueError("AWQ without zero points is not supported")
            return cls("awq", int(cfg.get("bits", cfg.get("w_bit", 4))),
                       int(cfg.get("group_size", cfg.get("q_group_size", 128))))
        if method == "gptq":
            if cfg.get("lm_head"):
                raise ValueError("a GPTQ checkpoint with a quantized lm_head is not supported")
            fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported")
            return cls("gptq", int(cfg.get("bits", 4)), int(cfg.get("group_size", 128)),
                       desc_act=bool(cfg.get("desc_act", False)),
                       zero_offset=1 if fmt == "gptq" else 0)
        raise ValueError(
            f"unsupported quantization method {method or '(none)'!r}; "
            f"Tandem supports {', '.join(SUPPORTED_METHODS)}"
        )
