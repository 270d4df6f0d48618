"""Find a model on disk and stream its tensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def resolve_model_dir(model: str | Path | None) -> Path:
    """A directory with config.json and safetensors, whatever was named.

    ``None`` means the bundled default model; a ``.gguf`` file (or a
    directory holding exactly one) is converted once and cached.
    """
    from engine.loader.default_model import default_model_path
    from engine.loader.gguf_convert import convert_gguf

    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is not a model: give a directory or a .gguf file")
        return convert_gguf(path)
    if (path / "config.json").is_file():
        if not _safetensors_files(path):
            raise ValueError(f"{path} has a config.json but no .safetensors weights")
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return convert_gguf(ggufs[0])
    raise ValueError(f"{path} holds no supported model (config.json + safetensors, or one .gguf)")


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    return sorted(model_dir.glob("*.safetensors"))


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a single-file or sharded checkpoint."""
    for file in _safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
