"""Quantized weights: GPTQ and AWQ (config, checkpoint formats), and 8-bit
FP8/INT8 weights in the compressed-tensors format."""

from typing import Any

from engine.quantization.compressed_config import METHOD as COMPRESSED_TENSORS
from engine.quantization.compressed_config import CompressedConfig
from engine.quantization.config import QuantConfig


def quant_config_from_dict(cfg: dict[str, Any]) -> QuantConfig | CompressedConfig:
    """A checkpoint's ``quantization_config``, whichever method wrote it."""
    if str(cfg.get("quant_method", "")).lower() == COMPRESSED_TENSORS:
        return CompressedConfig.from_dict(cfg)
    return QuantConfig.from_dict(cfg)


__all__ = ["CompressedConfig", "QuantConfig", "quant_config_from_dict"]
