"""Tiny random-weight Hugging Face models built from configs, saved as safetensors."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.quantization import QuantConfig
from engine.quantization.formats import checkpoint_tensors, quantize_rtn

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

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_checkpoint(src, dst, cfg: dict, act_order: bool = False):
    """Write ``src`` quantized as ``cfg`` says into ``dst``, and the same model
    with the dequantized weights in float into ``dst``-float; return both."""
    quant = QuantConfig.from_dict(cfg)
    weights = load_file(src / "model.safetensors")
    quantized, rounded = {}, {}
    for name, tensor in weights.items():
        layer = name.split(".")[-2] if name.endswith(".weight") else ""
        if layer not in LINEARS:
            quantized[name] = rounded[name] = tensor
            continue
        in_features = tensor.shape[1]
        g_idx = None
        if act_order:  # one random order per input, shared by q/k/v and gate/up (as in GPTQ)
            shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                      "up_proj": "gate_up"}.get(layer, layer)
            seed = zlib.crc32(f"{name.split('.')[2]}.{shared}".encode())
            perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
            g_idx = torch.empty(in_features, dtype=torch.int32)
            g_idx[perm] = torch.arange(in_features, dtype=torch.int32) // quant.group_of(in_features)
        ck = checkpoint_tensors(quant, tensor, g_idx)
        prefix = name.removesuffix(".weight")
        quantized.update({f"{prefix}.{k}": v for k, v in ck.items()})
        # The float twin straight from the rounding, not through Tandem's loader.
        q, scales, zeros, g = quantize_rtn(tensor, quant.bits, quant.group_size, g_idx,
                                           min_zero=quant.zero_offset)
        g = g.long()
        w = (q - zeros[g]).float() * scales.half().float()[g]
        rounded[name] = w.T.contiguous()
    float_dir = dst.parent / (dst.name + "-float")
    for path, tensors, extra in ((dst, quantized, {"quantization_config": cfg}),
                                 (float_dir, rounded, {})):
        path.mkdir(parents=True)
        config = json.loads((src / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(tensors, str(path / "model.safetensors"))
    return dst, float_dir
