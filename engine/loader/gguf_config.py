"""config.json for a GGUF model, from its ``<architecture>.*`` metadata.

GGUF keys are prefixed by the architecture (``llama.embedding_length``); the values map one to
one onto Hugging Face config fields, except rope scaling, which Llama 3.x files store as a tensor
of per-dimension factors (``rope_freqs.weight``) that we turn back into its four parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import ReaderTensor


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture maps onto its Hugging Face model class."""

    hf_class: str
    model_type: str
    # llama.cpp's converter interleaves the two rotary halves of each Llama q/k head; Qwen2's
    # converter leaves them alone.
    qk_permuted: bool
    qkv_bias: bool


ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM", "llama", qk_permuted=True, qkv_bias=False),
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2", qk_permuted=False, qkv_bias=True),
}


def model_config(
    meta: dict[str, Any],
    arch_name: str,
    arch: Architecture,
    tensors: dict[str, ReaderTensor],
    rope_freqs: np.ndarray | None,
) -> dict[str, Any]:
    """config.json contents. ``rope_freqs`` is the dequantized ``rope_freqs.weight``, if any."""

    def get(key: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch_name}.{key}", default)
        if value is ...:
            raise ValueError(f"GGUF metadata lacks {arch_name}.{key}")
        if isinstance(value, list):
            raise ValueError(f"per-layer {arch_name}.{key} is not supported")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(
            f"partial rotary embeddings ({arch_name}.rope.dimension_count) are not supported"
        )
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF has no token_embd.weight tensor")
    rope_theta = _f32(get("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        # NOTE: GGUF lists dims fastest-first, so token_embd's second dim is the vocabulary.
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch.model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False)
    rope_scaling = _rope_scaling(get, rope_freqs, head_dim, rope_theta)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(
    get: Callable[..., Any], rope_freqs: np.ndarray | None, head_dim: int, theta: float
) -> dict[str, Any] | None:
    kind = get("rope.scaling.type", "none")
    if rope_freqs is not None:
        if kind != "none":
            raise ValueError(f"both rope_freqs and rope scaling type {kind!r}: not supported")
        return _llama3_rope_scaling(rope_freqs, head_dim, theta)
    if kind == "none":
        return None
    factor = _f32(get("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        }
        for gguf_key, hf_key in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ("rope.scaling.attn_factor", "attention_factor"),
        ):
            if (value := get(gguf_key, None)) is not None:
                scaling[hf_key] = _f32(value)
        return scaling
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: linear, yarn)")


def _llama3_rope_scaling(freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover Llama 3.x's rope_scaling from the per-dimension factors llama.cpp stores.

    The factors follow from (factor, low_freq_factor, high_freq_factor, original context). Every
    Llama 3.1/3.2/3.3 release uses low=1, high=4, original=8192 and only varies `factor`, which is
    the largest stored value; we check that guess reproduces the stored factors exactly.
    """
    factor, low, high, original = float(freqs.max()), 1.0, 4.0, 8192
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < original / high,
        1.0,
        np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if expected.shape != freqs.shape or not np.allclose(expected, freqs, rtol=1e-4):
        raise ValueError("rope_freqs does not match Llama 3 rope scaling; not supported")
    return {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def _f32(value: float) -> float:
    """A GGUF float32 as the short decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))
