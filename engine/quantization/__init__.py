"""Weight-only GPTQ and AWQ quantization: config, checkpoint formats."""

from engine.quantization.config import QuantConfig

__all__ = ["QuantConfig"]
