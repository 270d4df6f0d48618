"""Quantize a float checkpoint into GPTQ, AWQ or compressed-tensors (FP8/INT8
with scales, or pack-quantized 4/8-bit integers) files (``tandem quantize``).

Round-to-nearest with per-group min/max: the file formats of GPTQ and AWQ,
not their calibration algorithms (those need data and a GPU, and choose
better roundings). Good for trying a quantized model end to end, for tests,
and at 8 bits for a model that barely changes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.loader.resolve import resolve_model_dir
from engine.loader.weights import iterate_weights
from engine.quantization import compressed, compressed_config, packed
from engine.quantization.config import PACKED_METHOD, QuantConfig
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


def is_linear_weight(name: str) -> bool:
    """Whether a checkpoint tensor is the weight of a decoder linear layer."""
    parts = name.split(".")
    return name.endswith(".weight") and len(parts) > 1 and parts[-2] in LINEAR_LAYERS


def quantize_weights(
    weights: Iterable[tuple[str, torch.Tensor]], quant: QuantConfig | compressed_config.CompressedConfig,
    g_idx_of: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None,
) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with every linear weight replaced by its
    quantized tensors; ``g_idx_of(name, weight)`` may give a layer an
    act-order group assignment."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if not is_linear_weight(name):
            tensors[name] = tensor.contiguous()
            continue
        prefix = name.removesuffix(".weight")
        if isinstance(quant, compressed_config.CompressedConfig):
            written = compressed.checkpoint_tensors(quant, tensor)
        elif quant.method == PACKED_METHOD:
            written = packed.checkpoint_tensors(quant, tensor)
        else:
            g_idx = g_idx_of(name, tensor) if g_idx_of is not None else None
            written = checkpoint_tensors(quant, tensor, g_idx)
        for key, value in written.items():
            tensors[f"{prefix}.{key}"] = value.contiguous()
    return tensors


def save_model(src: Path, out: Path, tensors: dict[str, torch.Tensor],
               config_updates: dict[str, Any]) -> Path:
    """``tensors`` as a model directory ``out``: ``src``'s config.json with
    ``config_updates``, and its tokenizer and generation files."""
    out.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **config_updates}, indent=2))
    for side in _SIDE_FILES:
        if (src / side).is_file():
            shutil.copy2(src / side, out / side)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def quantize_model(model: str | None, out: Path, method: str, bits: int, group_size: int) -> Path:
    """Write ``model`` (a directory, a .gguf, None: the bundled default)
    quantized into ``out``, a new directory; returns it. ``method`` is gptq,
    awq, a pack-quantized scheme of ``compressed_config.PACKED_SCHEMES``, or
    one of ``compressed_config.SCHEMES`` (8-bit weights with scales; ``bits``
    and ``group_size`` are then unused)."""
    src = resolve_model_dir(model)
    out = Path(out)
    if out.exists():
        raise ValueError(f"{out} already exists; choose a new directory")
    if json.loads((src / "config.json").read_text()).get("quantization_config"):
        raise ValueError(f"{src} is quantized already; start from a float model")
    if method in compressed_config.SCHEMES:
        scheme = compressed_config.CompressedConfig(*compressed_config.SCHEMES[method])
        cfg = scheme.to_dict()
        tensors = quantize_weights(iterate_weights(src), scheme)
        return save_model(src, out, tensors, {"quantization_config": cfg})
    if method in compressed_config.PACKED_SCHEMES:
        symmetric = compressed_config.PACKED_SCHEMES[method]
        cfg = compressed_config.packed_config_dict(bits, group_size, symmetric)
        quant = compressed_config.read_config(cfg)
    else:
        cfg = quant_config_dict(method, bits, group_size)
        quant = QuantConfig.from_dict(cfg)
    tensors = quantize_weights(iterate_weights(src), quant)
    return save_model(src, out, tensors, {"quantization_config": cfg})
