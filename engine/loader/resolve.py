"""Find a model on disk. Torch-free: the gateway resolves the model too, for
its tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def resolve_model_dir(model: str | Path | None, allow_no_weights: bool = False) -> Path:
    """A directory with config.json and safetensors, whatever was named.

    ``None`` means the bundled default model; a ``.gguf`` file (or a
    directory holding exactly one) is converted once and cached.
    """
    from engine.loader.default_model import default_model_path

    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is not a model: give a directory or a .gguf file")
        return _convert_gguf(path)
    if (path / "config.json").is_file():
        if not safetensors_files(path) and not allow_no_weights:
            raise ValueError(f"{path} has a config.json but no .safetensors weights")
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _convert_gguf(ggufs[0])
    raise ValueError(f"{path} holds no supported model (config.json + safetensors, or one .gguf)")


def _convert_gguf(path: Path) -> Path:
    # Imported here: the gguf package is needed for GGUF files alone, not to
    # load a Hugging Face directory.
    from engine.loader.gguf_convert import convert_gguf

    return convert_gguf(path)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    return sorted(model_dir.glob("*.safetensors"))


def model_fingerprint(model_dir: Path) -> str:
    """Identifies the weights a worker serves; workers compare it before
    moving KV, the gateway before routing to them.

    Covers config.json, each safetensors file's header (tensor names, shapes,
    dtypes, offsets) and a few 64 KiB samples of its data, so two fine-tunes
    of one base model differ. Reads well under a megabyte.
    """
    h = hashlib.sha256()
    h.update((Path(model_dir) / "config.json").read_bytes())
    for f in safetensors_files(Path(model_dir)):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(header_len, 1 << 24)))
            for fraction in (0.25, 0.5, 0.75, 0.999):
                fh.seek(int(size * fraction))
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()[:16]


_SAMPLE_BYTES = 64 << 10
