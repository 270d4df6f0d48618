"""What an engine's settings come to on this host before any weight loads:
the concrete dtype, the model's directory and architecture, the context
limit.

The engine resolves its settings here, and so does a follower node of a
tensor-parallel group spread over hosts (engine/parallel/node.py), so the
shards of one model are built from the same answers; the leader compares
them at the handshake.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig, ModelConfig
from engine.dtypes import resolve_dtype
from engine.loader.resolve import resolve_model_dir
from engine.quantization import CompressedConfig


@dataclass(frozen=True)
class ResolvedModel:
    # "auto" and the like replaced by what runs (the dtype).
    config: EngineConfig
    model_dir: Path
    model_config: ModelConfig
    max_model_len: int


def resolve_model(config: EngineConfig) -> ResolvedModel:
    """ValueError if the model is not there, not supported, or not what the
    settings ask for (quantization, max_model_len)."""
    config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, config.device))
    model_dir = resolve_model_dir(config.model, allow_no_weights=config.load_format == "dummy")
    model_config = _check_quantization(config, model_dir, ModelConfig.from_dir(model_dir))
    return ResolvedModel(config, model_dir, model_config, _max_model_len(config, model_config))


def _check_quantization(config: EngineConfig, model_dir: Path,
                        model_config: ModelConfig) -> ModelConfig:
    asked = config.quantization
    found = model_config.quantization
    if asked == "fp8" and found is None:  # quantize the float checkpoint at load
        return dataclasses.replace(model_config, quantization=CompressedConfig.online_fp8())
    if asked == "fp8" and getattr(found, "weight_type", None) == "float":
        return model_config  # an FP8 compressed-tensors checkpoint is what fp8 asks for
    if asked is not None and (found is None or found.method != asked):
        have = f"{found.method}-quantized" if found else "not quantized"
        raise ValueError(f"quantization={asked!r} was asked for, but {model_dir} is {have}")
    return model_config


def _max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    model_max = model_config.max_model_len
    asked = config.scheduler.max_model_len
    if asked is None:
        return model_max
    if asked > model_max:
        raise ValueError(f"max_model_len {asked} exceeds the model's limit of {model_max}")
    return asked


def eos_token_ids(resolved: ResolvedModel, tokenizer) -> tuple[int, ...]:
    """Every token that ends a sequence: the model config's, the generation
    config's and the tokenizer's (a ``Tokenizer`` or None)."""
    ids = set(resolved.model_config.eos_token_ids)
    gen = resolved.model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
