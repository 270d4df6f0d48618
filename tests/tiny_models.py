"""Tiny random-weight Hugging Face models built from configs, saved as safetensors."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.quantization import QuantConfig
from engine.quantization.formats import quantize_rtn
from engine.quantization.writer import is_linear_weight, quantize_weights, save_model

TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=8, max_position_embeddings=1024, rms_norm_eps=1e-5,
    # Large weights separate the logits, so greedy argmax is not decided by
    # float rounding between two ways of computing the same thing.
    initializer_range=0.3, bos_token_id=1, eos_token_id=2,
)

VARIANTS = {
    # name: (architecture, extra config)
    "llama-gqa": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mqa-tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3-rope": ("llama", dict(num_key_value_heads=4, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "qwen2": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral": ("mistral", dict(num_key_value_heads=2, sliding_window=None)),
}


def build_tiny_model(name: str, root: Path, **overrides):
    """Save a tiny random model under root/name; return (dir, hf_model).
    ``overrides`` change its config (e.g. ``vocab_size``)."""
    import transformers

    arch, extra = VARIANTS[name]
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}[arch]
    torch.manual_seed(1234)
    config = cfg_cls(**{**TINY, **extra, **overrides})
    model = model_cls(config).eval()
    path = root / name
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


# ---- quantized checkpoints ---------------------------------------------------

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}

def quantize_checkpoint(src, dst, cfg: dict, act_order: bool = False):
    """Write ``src`` quantized as ``cfg`` says into ``dst``, and the same model
    with the dequantized weights in float into ``dst``-float; return both."""
    quant = QuantConfig.from_dict(cfg)
    weights = load_file(src / "model.safetensors")

    def g_idx_of(name: str, weight: torch.Tensor) -> torch.Tensor | None:
        """One random order per input, shared by q/k/v and gate/up (as in GPTQ)."""
        if not act_order:
            return None
        layer = name.split(".")[-2]
        shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                  "up_proj": "gate_up"}.get(layer, layer)
        seed = zlib.crc32(f"{name.split('.')[2]}.{shared}".encode())
        in_features = weight.shape[1]
        perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(in_features, dtype=torch.int32)
        g_idx[perm] = torch.arange(in_features, dtype=torch.int32) // quant.group_of(in_features)
        return g_idx

    def float_twin(name: str, weight: torch.Tensor) -> torch.Tensor:
        """Straight from the rounding, not through Tandem's loader."""
        q, scales, zeros, g = quantize_rtn(weight, quant.bits, quant.group_size,
                                           g_idx_of(name, weight), min_zero=quant.zero_offset)
        g = g.long()
        return ((q - zeros[g]).float() * scales.half().float()[g]).T.contiguous()

    quantized = quantize_weights(weights.items(), quant, g_idx_of)
    rounded = {n: float_twin(n, t) if is_linear_weight(n) else t for n, t in weights.items()}
    save_model(src, dst, quantized, {"quantization_config": cfg})
    float_dir = save_model(src, dst.parent / (dst.name + "-float"), rounded, {})
    return dst, float_dir
