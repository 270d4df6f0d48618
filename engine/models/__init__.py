"""Model architectures by Hugging Face architecture name."""

from __future__ import annotations

from engine.attention import AttentionBackend
from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.parallel import TensorParallel

# Qwen2 differs from Llama only in the q/k/v biases, Mistral only in its
# sliding window (which caps max_model_len); ModelConfig carries both.
_REGISTRY = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}


def build_model(cfg: ModelConfig, backend: AttentionBackend, max_position: int,
                tp: TensorParallel | None = None) -> LlamaForCausalLM:
    try:
        cls = _REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {cfg.architecture!r}; "
            f"Tandem supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
    return cls(cfg, backend, max_position, tp or TensorParallel())
