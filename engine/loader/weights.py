"""Stream a checkpoint's tensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.loader.resolve import safetensors_files


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a single-file or sharded checkpoint."""
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
