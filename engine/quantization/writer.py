"""Quantize a float checkpoint into GPTQ or AWQ files (``tandem quantize``).

Round-to-nearest with per-group min/max: the file formats of GPTQ and AWQ,
not their calibration algorithms (those need data and a GPU, and choose
better roundings). Good for trying a quantized model end to end, for tests,
and at 8 bits for a model that barely changes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.loader.resolve import resolve_model_dir
from engine.loader.weights import iterate_weights
from engine.quantization.config import QuantConfig
from engine.quantization.formats import checkpoint_tensors

# The decoder's linear layers, by their Hugging Face names.
LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
               "special_tokens_map.json")


def quant_config_dict(method: str, bits: int, group_size: int) -> dict[str, Any]:
    """The ``quantization_config`` the tools write, validated."""
    if method == "gptq":
        cfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
               "desc_act": False, "sym": False, "checkpoint_format": "gptq"}
    else:
        cfg = {"quant_method": method, "bits": bits, "group_size": group_size,
               "zero_point": True, "version": "gemm"}
    QuantConfig.from_dict(cfg)  # ValueError for what Tandem cannot load
    return cfg


def quantize_model(model: str | None, out: Path, method: str, bits: int, group_size: int) -> Path:
    """Write ``model`` (a directory, a .gguf, None: the bundled default)
    quantized into ``out``, a new directory; returns it."""
    src = resolve_model_dir(model)
    out = Path(out)
    if out.exists():
        raise ValueError(f"{out} already exists; choose a new directory")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is quantized already; start from a float model")
    cfg = quant_config_dict(method, bits, group_size)
    quant = QuantConfig.from_dict(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iterate_weights(src):
        parts = name.split(".")
        if name.endswith(".weight") and len(parts) > 1 and parts[-2] in LINEAR_LAYERS:
            prefix = name.removesuffix(".weight")
            for key, value in checkpoint_tensors(quant, tensor).items():
                tensors[f"{prefix}.{key}"] = value.contiguous()
        else:
            tensors[name] = tensor.contiguous()
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": cfg}, indent=2))
    for side in _SIDE_FILES:
        if (src / side).is_file():
            shutil.copy2(src / side, out / side)
    save_file(tensors, str(out / "model.safetensors"))
    return out
