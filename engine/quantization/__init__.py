"""Quantized weights: GPTQ and AWQ (config, checkpoint formats), and
compressed-tensors checkpoints: 8-bit FP8/INT8 weights with scales, and
pack-quantized 4/8-bit integers."""

from typing import Any

from engine.quantization.compressed_config import METHOD as COMPRESSED_TENSORS
from engine.quantization.compressed_config import CompressedConfig, read_config
from engine.quantization.config import QuantConfig


def quant_config_from_dict(cfg: dict[str, Any]) -> QuantConfig | CompressedConfig:
    """A checkpoint's ``quantization_config``, whichever method wrote it."""
    if str(cfg.get("quant_method", "")).lower() == COMPRESSED_TENSORS:
        return read_config(cfg)
    return QuantConfig.from_dict(cfg)


__all__ = ["CompressedConfig", "QuantConfig", "quant_config_from_dict"]
