"""The sampling defaults a model ships in its ``generation_config.json``.

Instruct checkpoints set how they are meant to be sampled (Qwen2.5's
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05). As vLLM
does by default (``generation_config="auto"``), they replace the built-in
defaults of whatever a request leaves unset: ``LLM.generate`` without
sampling params, and the fields an OpenAI request does not send. ``"vllm"``
(vLLM's name) ignores the file. Torch-free: the gateway reads it too.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CHOICES = ("auto", "vllm")

# generation_config.json's name -> SamplingParams'.
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_choice(source: str) -> None:
    if source not in CHOICES:
        raise ValueError(f"generation_config must be one of {', '.join(CHOICES)}, "
                         f"got {source!r}")


def sampling_defaults(model_dir: Path | str, source: str = "auto") -> dict[str, Any]:
    """SamplingParams' keyword arguments the model's file sets (empty for
    ``source="vllm"``, or no file). A malformed file, or values
    SamplingParams refuses, are a ValueError naming the file."""
    check_choice(source)
    path = Path(model_dir) / "generation_config.json"
    if source == "vllm" or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    # NOTE: do_sample false means greedy in transformers, whatever the
    # temperature says; vLLM reads the values alone, and so does this.
    defaults = {ours: config[theirs] for theirs, ours in _FIELDS.items()
                if config.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if defaults:
        logger.info("sampling defaults from the model's generation_config.json: %s "
                    "(generation_config='vllm' ignores them)", defaults)
    return defaults
