"""The ``quantization_config`` of a compressed-tensors checkpoint: 8-bit
weights with scales (engine/quantization/compressed.py describes them), or
``pack-quantized`` integers (engine/quantization/packed.py). No torch here:
engine/config.py imports it and must stay importable without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.quantization.config import PACKED_METHOD, QuantConfig

METHOD = PACKED_METHOD  # "compressed-tensors"
FORMATS = ("float-quantized", "int-quantized", "naive-quantized")  # 8-bit, ScaledLinear
PACKED = "pack-quantized"  # 4- or 8-bit integers in int32 words, QuantLinear


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
        group, fmt = single_group(cfg)
        if fmt not in FORMATS:
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported; "
                             f"Tandem reads {', '.join((*FORMATS, PACKED))}")
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8:
            raise ValueError(f"{weights.get('num_bits')}-bit compressed-tensors weights are not "
                             f"supported in {fmt}; Tandem reads 8-bit float or int (4 bits: "
                             f"{PACKED})")
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


def single_group(cfg: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The one config group of a checkpoint that quantizes every decoder
    linear layer alike, and its format."""
    groups = cfg.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config groups is not "
                         "supported; Tandem reads checkpoints with one scheme for all layers")
    group = next(iter(groups.values()))
    if "Linear" not in (group.get("targets") or []):
        raise ValueError("compressed-tensors config group must target Linear layers")
    ignored = [n for n in cfg.get("ignore") or [] if "lm_head" not in n]
    if ignored:
        raise ValueError(f"compressed-tensors checkpoints that leave decoder layers "
                         f"unquantized ({ignored[:3]}) are not supported")
    return group, group.get("format") or cfg.get("format")


def read_config(cfg: dict[str, Any]) -> CompressedConfig | QuantConfig:
    """A compressed-tensors ``quantization_config``: 8-bit weights with scales
    (CompressedConfig), or pack-quantized integers (a QuantConfig)."""
    group, fmt = single_group(cfg)
    return packed_config(group) if fmt == PACKED else CompressedConfig.from_dict(cfg)


def packed_config(group: dict[str, Any]) -> QuantConfig:
    """llm-compressor's W4A16 / W8A16: ``bits``-bit integers, a scale per
    output channel or per group of ``group_size`` inputs, zero points when
    asymmetric, act-order group indices when ``actorder`` is "group"."""
    weights = group.get("weights") or {}
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    if group.get("input_activations"):
        raise ValueError(f"{PACKED} with quantized input activations is not supported; "
                         "Tandem reads weight-only (WnA16) packed checkpoints")
    if weights.get("type", "int") != "int" or bits not in (4, 8):
        raise ValueError(f"{PACKED} {weights.get('type')} weights of {bits} bits are not "
                         "supported; Tandem reads 4- or 8-bit int")
    if weights.get("dynamic"):
        raise ValueError(f"dynamic {PACKED} weights are not supported")
    if strategy not in ("channel", "group"):
        raise ValueError(f"{PACKED} weight strategy {strategy!r} is not supported; "
                         "use channel or group")
    group_size = int(weights.get("group_size") or 0) if strategy == "group" else -1
    if strategy == "group" and group_size < 1:
        raise ValueError(f"a {PACKED} group strategy needs a positive group_size")
    symmetric = bool(weights.get("symmetric", True))
    return QuantConfig(PACKED_METHOD, int(bits), group_size,
                       desc_act=weights.get("actorder") in (True, "group"),
                       zero_offset=1 << (int(bits) - 1), stored_zeros=not symmetric)


def packed_config_dict(bits: int, group_size: int, symmetric: bool) -> dict[str, Any]:
    """The ``quantization_config`` of a pack-quantized checkpoint, validated."""
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size, "actorder": None}
    cfg = {"quant_method": METHOD, "format": PACKED, "quantization_status": "compressed",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                         "input_activations": None}},
           "ignore": ["lm_head"]}
    read_config(cfg)  # ValueError for what Tandem cannot load
    return cfg


# What ``tandem quantize --method`` writes as pack-quantized (llm-compressor's
# WnA16; ``--bits`` and ``--group-size`` as asked): method -> symmetric.
PACKED_SCHEMES = {"wna16": True, "wna16-asym": False}
