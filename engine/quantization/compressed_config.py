"""The ``quantization_config`` of an 8-bit compressed-tensors checkpoint
(engine/quantization/compressed.py describes the format). No torch here:
engine/config.py imports it and must stay importable without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHOD = "compressed-tensors"
FORMATS = ("float-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True)
class CompressedConfig:
    """One scheme for every decoder linear layer (embeddings, norms and the
    LM head stay in the model's dtype)."""

    weight_type: str  # "float" (fp8 e4m3) or "int" (int8)
    strategy: str  # "tensor" or "channel": how many weight scales
    activations: str | None = None  # None (weight-only), "token" or "tensor" (dynamic)
    # True: quantize a float checkpoint at load (quantization="fp8").
    online: bool = False
    method: str = METHOD

    def __post_init__(self) -> None:
        if self.weight_type not in ("float", "int"):
            raise ValueError(f"compressed-tensors weights of type {self.weight_type!r} "
                             "are not supported; use float or int")
        if self.strategy not in ("tensor", "channel"):
            raise ValueError(f"compressed-tensors weight strategy {self.strategy!r} is not "
                             "supported; use tensor or channel")
        if self.activations not in (None, "token", "tensor"):
            raise ValueError(f"activation strategy {self.activations!r} is not supported; "
                             "use token or tensor (dynamic)")

    @property
    def scheme(self) -> str:
        bits = "FP8" if self.weight_type == "float" else "INT8"
        return f"{bits} W8A{'8' if self.activations else '16'} per-{self.strategy}"

    @classmethod
    def online_fp8(cls) -> CompressedConfig:
        """``quantization="fp8"``: per-channel e4m3 weights, inputs per token."""
        return cls("float", "channel", "token", online=True)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> CompressedConfig:
        fmt = cfg.get("format")
        groups = cfg.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors with {len(groups)} config groups is not "
                             "supported; Tandem reads checkpoints with one scheme for all layers")
        group = next(iter(groups.values()))
        weights = group.get("weights") or {}
        fmt = group.get("format") or fmt
        if fmt not in FORMATS:
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported; "
                             f"Tandem reads {', '.join(FORMATS)}")
        if "Linear" not in (group.get("targets") or []):
            raise ValueError("compressed-tensors config group must target Linear layers")
        ignored = [n for n in cfg.get("ignore") or [] if "lm_head" not in n]
        if ignored:
            raise ValueError(f"compressed-tensors checkpoints that leave decoder layers "
                             f"unquantized ({ignored[:3]}) are not supported")
        if weights.get("num_bits") != 8:
            raise ValueError(f"{weights.get('num_bits')}-bit compressed-tensors weights are not "
                             "supported; Tandem reads 8-bit float or int")
        if not weights.get("symmetric", True) or weights.get("dynamic"):
            raise ValueError("only symmetric, static compressed-tensors weights are supported")
        acts = group.get("input_activations")
        strategy = None
        if acts:
            if not acts.get("dynamic"):
                raise ValueError("static input activation scales are not supported; "
                                 "use a checkpoint with dynamic activations")
            if acts.get("type", weights.get("type")) != weights.get("type"):
                raise ValueError("activations and weights of different types are not supported")
            strategy = acts.get("strategy", "token")
        return cls(str(weights.get("type")), str(weights.get("strategy")), strategy)

    def to_dict(self) -> dict[str, Any]:
        """The ``quantization_config`` a checkpoint of this scheme carries."""
        weights = {"num_bits": 8, "type": self.weight_type, "symmetric": True,
                   "strategy": self.strategy, "dynamic": False, "group_size": None}
        acts = None if self.activations is None else {
            "num_bits": 8, "type": self.weight_type, "symmetric": True,
            "strategy": self.activations, "dynamic": True}
        fmt = "float-quantized" if self.weight_type == "float" else "int-quantized"
        return {"quant_method": METHOD, "format": fmt, "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": acts}},
                "ignore": ["lm_head"]}


# What ``tandem quantize --method`` writes: (weight type, strategy, activations).
SCHEMES = {
    "fp8": ("float", "channel", "token"),  # llm-compressor's FP8_DYNAMIC
    "fp8-w8a16": ("float", "channel", None),
    "fp8-tensor": ("float", "tensor", None),
    "int8": ("int", "channel", "token"),  # W8A8, dynamic per-token inputs
    "int8-w8a16": ("int", "channel", None),
}
