"""Tiny random-weight Hugging Face models built from configs, saved as safetensors."""

from __future__ import annotations

from pathlib import Path

import torch

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


def build_tiny_model(name: str, root: Path):
    """Save a tiny random model under root/name; return (dir, hf_model)."""
    import transformers

    arch, extra = VARIANTS[name]
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}[arch]
    torch.manual_seed(1234)
    config = cfg_cls(**{**TINY, **extra})
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
