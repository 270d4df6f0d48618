"""Turn a GGUF file into a Hugging Face-style model directory, cached on disk.

The engine has one loading path: a directory with config.json, model.safetensors,
tokenizer.json and tokenizer_config.json. A GGUF is converted into that shape once:

    GGUF ──read──> metadata ──gguf_config──> config.json, generation_config.json
                   tensors  ──gguf_tensors: dequantize, rename, un-permute q/k──>
                                model.safetensors (float32)
                   tokenizer.ggml.* ──gguf_tokenizer──> tokenizer.json, tokenizer_config.json

The result lives in ``<cache root>/gguf/<stem>-<key>`` where the key hashes the file's absolute
path, size, mtime and CONVERTER_VERSION. A conversion is written to a temporary directory beside it
and renamed into place, so a cache entry is either complete or absent: a second call, or another
process, never sees half a conversion and never reads tensors again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from gguf import GGUFReader

from engine.loader.gguf_config import ARCHITECTURES, model_config
from engine.loader.gguf_tensors import (
    ROPE_FREQS,
    check_tensor_types,
    dequantized,
    hf_names,
    hf_weights,
    write_safetensors,
)
from engine.loader.gguf_tokenizer import build_tokenizer

logger = logging.getLogger("engine.loader")

# Bump whenever the output for the same GGUF changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1


def convert_gguf(gguf_path: str | os.PathLike[str], cache_root: Path | None = None) -> Path:
    """Convert ``gguf_path`` to a Hugging Face-style directory and return that directory.

    ``cache_root`` plays the role of ``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem``); the
    conversion goes under its ``gguf/`` folder. Raises FileNotFoundError for a missing file and
    ValueError for a file that is not GGUF or uses an architecture or tensor type we cannot load.
    """
    path = Path(gguf_path).expanduser().resolve()
    _check_is_gguf(path)
    target = _cache_dir(path, cache_root)
    if _is_complete(target):
        logger.info("using cached conversion %s", target)
        return target

    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)
        _convert(path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):
                raise
            # NOTE: another process finished the same conversion first; theirs is as good.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s to %s in %.1fs", path, target, time.perf_counter() - start)
    return target


def _cache_dir(path: Path, cache_root: Path | None) -> Path:
    if cache_root is None:
        env = os.environ.get("TANDEM_CACHE_DIR")
        cache_root = Path(env) if env else Path.home() / ".cache" / "tandem"
    stat = path.stat()
    identity = f"{CONVERTER_VERSION}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return Path(cache_root).expanduser() / "gguf" / f"{path.stem}-{key}"


def _is_complete(target: Path) -> bool:
    # The directory only ever appears by rename of a finished conversion.
    return (target / "config.json").is_file()


def _check_is_gguf(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")


def _convert(path: Path, out: Path) -> None:
    try:
        reader = GGUFReader(path)
    except ValueError as e:  # the reader's own messages are about numpy views, not the file
        raise ValueError(f"{path}: cannot read GGUF (truncated or corrupt?): {e}") from e
    meta = {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }
    arch_name = meta.get("general.architecture")
    arch = ARCHITECTURES.get(arch_name)  # type: ignore[arg-type]
    if arch is None:
        raise ValueError(
            f"{path.name}: GGUF architecture {arch_name!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    tensors = {t.name: t for t in reader.tensors}
    # Everything cheap is checked before the first large tensor is dequantized.
    check_tensor_types(tensors, path.name)
    rope_freqs = tensors.get(ROPE_FREQS)
    config = model_config(
        meta, arch_name, arch, tensors, None if rope_freqs is None else dequantized(rope_freqs)
    )
    names = hf_names(tensors, arch, config["num_hidden_layers"])
    tokenizer, tokenizer_config = build_tokenizer(meta)

    write_safetensors(out / "model.safetensors", hf_weights(tensors, names, arch, config))
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    generation_config = {
        k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "generation_config.json", generation_config)
    # Written last, so even a copy of a half-converted directory never looks complete.
    _write_json(out / "config.json", config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
