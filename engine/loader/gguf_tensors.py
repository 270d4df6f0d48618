"""GGUF tensors as Hugging Face float32 weights: rename, dequantize, un-permute, write.

Tensors are produced one at a time while ``model.safetensors`` is written, so converting a
model never holds more than one dequantized tensor in memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from engine.loader.gguf_config import Architecture

_Q = GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {
        _Q.F32, _Q.F16, _Q.BF16,
        _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
        _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
    }
)  # fmt: skip

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BIAS_NAMES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
# (HF name, shape, a function that dequantizes it): tensors are produced one at a time.
Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]
# Llama 3.x stores its rope scaling as per-dimension factors; it becomes config, not a weight.
ROPE_FREQS = "rope_freqs.weight"


def check_tensor_types(tensors: dict[str, ReaderTensor], file_name: str) -> None:
    """Refuse a file with a tensor type we cannot dequantize, before any tensor is read."""
    unsupported = sorted(
        {t.tensor_type.name for t in tensors.values()} - {t.name for t in SUPPORTED_TYPES}
    )
    if unsupported:
        raise ValueError(
            f"{file_name}: tensor type(s) {', '.join(unsupported)} are not supported "
            f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
        )


def hf_names(
    tensors: dict[str, ReaderTensor], arch: Architecture, num_layers: int
) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, refusing any tensor we would otherwise drop."""
    layer_names = _LAYER_NAMES | (_BIAS_NAMES if arch.qkv_bias else {})
    names = {}
    for name in tensors:
        if name == ROPE_FREQS:
            continue
        if name in _GLOBAL_NAMES:
            names[name] = _GLOBAL_NAMES[name]
            continue
        block, _, rest = name.partition(".")[2].partition(".")
        if (
            name.startswith("blk.")
            and block.isdigit()
            and int(block) < num_layers
            and rest in layer_names
        ):
            names[name] = f"model.layers.{block}.{layer_names[rest]}"
            continue
        raise ValueError(f"unexpected tensor {name!r} for architecture {arch.model_type}")
    required = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{hf_name}" for i in range(num_layers) for hf_name in layer_names.values()
    }
    if missing := sorted(required - set(names.values())):
        raise ValueError(f"GGUF lacks tensors for {', '.join(missing[:5])}")
    return names


def hf_weights(
    tensors: dict[str, ReaderTensor],
    names: dict[str, str],
    arch: Architecture,
    config: dict[str, Any],
) -> Iterable[Entry]:
    """(HF name, shape, loader) triples; the loaders run one at a time while writing."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    def load(tensor: ReaderTensor) -> np.ndarray:
        weight = dequantized(tensor)
        kind = tensor.name.split(".")[-2]
        if arch.qk_permuted and kind in heads:
            weight = unpermute_rotary(weight, heads[kind])
        return weight

    for name in sorted(names, key=lambda n: names[n]):
        tensor = tensors[name]
        yield names[name], _shape(tensor), lambda t=tensor: load(t)


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute(weights, n_head)`` on the rows of a q/k projection.

    Within one head HF keeps the two rotary halves apart, llama.cpp interleaves them:

        HF    rows  x0 x1 .. x(d/2-1) y0 y1 .. y(d/2-1)
        GGUF  rows  x0 y0 x1 y1 .. x(d/2-1) y(d/2-1)
    """
    head_dim = weight.shape[0] // num_heads
    split = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _shape(tensor: ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dims fastest-first: [in_features, out_features] is a torch [out, in] weight.
    return tuple(int(d) for d in reversed(tensor.shape))


def dequantized(tensor: ReaderTensor) -> np.ndarray:
    """The tensor as float32, in torch's dimension order."""
    return dequantize(tensor.data, tensor.tensor_type).reshape(_shape(tensor))


def write_safetensors(path: Path, entries: Iterable[Entry]) -> None:
    """Write float32 tensors in safetensors format, holding one tensor in memory at a time."""
    entries = list(entries)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        size = 4 * int(np.prod(shape))
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes with spaces
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, load in entries:
            array = np.ascontiguousarray(load(), dtype="<f4")
            if array.shape != shape:
                raise ValueError(f"{name}: dequantized to {array.shape}, expected {shape}")
            f.write(memoryview(array).cast("B"))
