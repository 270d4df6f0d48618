"""Turn a GGUF file into a Hugging Face-style model directory, cached on disk.

The engine has one loading path: a directory with config.json, model.safetensors,
tokenizer.json and tokenizer_config.json. A GGUF is converted into that shape once:

    GGUF ──read──> metadata ──> config.json, generation_config.json
                   tensors  ──dequantize, rename, un-permute q/k──> model.safetensors (float32)
                   tokenizer.ggml.* ──> tokenizer.json (`tokenizers`), tokenizer_config.json

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
import struct
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

logger = logging.getLogger("engine.loader")

# Bump whenever the output for the same GGUF changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1

_Q = GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {
        _Q.F32, _Q.F16, _Q.BF16,
        _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
        _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
    }
)  # fmt: skip


@dataclass(frozen=True)
class _Architecture:
    hf_class: str
    model_type: str
    # llama.cpp's converter interleaves the two rotary halves of each Llama q/k head; Qwen2's
    # converter leaves them alone.
    qk_permuted: bool
    qkv_bias: bool


ARCHITECTURES = {
    "llama": _Architecture("LlamaForCausalLM", "llama", qk_permuted=True, qkv_bias=False),
    "qwen2": _Architecture("Qwen2ForCausalLM", "qwen2", qk_permuted=False, qkv_bias=True),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BIAS_NAMES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
# (HF name, shape, a function that dequantizes it): tensors are produced one at a time.
_Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]
# Llama 3.x stores its rope scaling as per-dimension factors; it becomes config, not a weight.
_ROPE_FREQS = "rope_freqs.weight"


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
    # Everything cheap is checked before the first tensor is dequantized.
    unsupported = sorted(
        {t.tensor_type.name for t in tensors.values()} - {t.name for t in SUPPORTED_TYPES}
    )
    if unsupported:
        raise ValueError(
            f"{path.name}: tensor type(s) {', '.join(unsupported)} are not supported "
            f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
        )
    config = _model_config(meta, arch_name, arch, tensors)
    names = _hf_names(tensors, arch, config["num_hidden_layers"])
    tokenizer, tokenizer_config = _build_tokenizer(meta)

    _write_safetensors(out / "model.safetensors", _weights(tensors, names, arch, config))
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    generation_config = {
        k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "generation_config.json", generation_config)
    # Written last, so even a copy of a half-converted directory never looks complete.
    _write_json(out / "config.json", config)


def _model_config(
    meta: dict[str, Any], arch_name: str, arch: _Architecture, tensors: dict[str, ReaderTensor]
) -> dict[str, Any]:
    def get(key: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch_name}.{key}", default)
        if value is ...:
            raise ValueError(f"GGUF metadata lacks {arch_name}.{key}")
        if isinstance(value, list):
            raise ValueError(f"per-layer {arch_name}.{key} is not supported")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(
            f"partial rotary embeddings ({arch_name}.rope.dimension_count) are not supported"
        )
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF has no token_embd.weight tensor")
    rope_theta = _f32(get("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        # NOTE: GGUF lists dims fastest-first, so token_embd's second dim is the vocabulary.
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch.model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False)
    rope_scaling = _rope_scaling(get, tensors.get(_ROPE_FREQS), head_dim, rope_theta)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(
    get: Callable[..., Any], rope_freqs: ReaderTensor | None, head_dim: int, theta: float
) -> dict[str, Any] | None:
    kind = get("rope.scaling.type", "none")
    if rope_freqs is not None:
        if kind != "none":
            raise ValueError(f"both rope_freqs and rope scaling type {kind!r}: not supported")
        return _llama3_rope_scaling(_dequantized(rope_freqs), head_dim, theta)
    if kind == "none":
        return None
    factor = _f32(get("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        }
        for gguf_key, hf_key in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ("rope.scaling.attn_factor", "attention_factor"),
        ):
            if (value := get(gguf_key, None)) is not None:
                scaling[hf_key] = _f32(value)
        return scaling
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: linear, yarn)")


def _llama3_rope_scaling(freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover Llama 3.x's rope_scaling from the per-dimension factors llama.cpp stores.

    The factors follow from (factor, low_freq_factor, high_freq_factor, original context). Every
    Llama 3.1/3.2/3.3 release uses low=1, high=4, original=8192 and only varies `factor`, which is
    the largest stored value; we check that guess reproduces the stored factors exactly.
    """
    factor, low, high, original = float(freqs.max()), 1.0, 4.0, 8192
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < original / high,
        1.0,
        np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if expected.shape != freqs.shape or not np.allclose(expected, freqs, rtol=1e-4):
        raise ValueError("rope_freqs does not match Llama 3 rope scaling; not supported")
    return {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def _hf_names(
    tensors: dict[str, ReaderTensor], arch: _Architecture, num_layers: int
) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, refusing any tensor we would otherwise drop."""
    layer_names = _LAYER_NAMES | (_BIAS_NAMES if arch.qkv_bias else {})
    names = {}
    for name in tensors:
        if name == _ROPE_FREQS:
            continue
        if name in _GLOBAL_NAMES:
            names[name] = _GLOBAL_NAMES[name]
            continue
        block, _, rest = name.partition(".")[2].partition(".")
        if (
            name.startswith("blk.")
            and block.isdigit()
            and int(block) < num_layers
            and rest in layer_names
        ):
            names[name] = f"model.layers.{block}.{layer_names[rest]}"
            continue
        raise ValueError(f"unexpected tensor {name!r} for architecture {arch.model_type}")
    required = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{hf_name}" for i in range(num_layers) for hf_name in layer_names.values()
    }
    if missing := sorted(required - set(names.values())):
        raise ValueError(f"GGUF lacks tensors for {', '.join(missing[:5])}")
    return names


def _weights(
    tensors: dict[str, ReaderTensor],
    names: dict[str, str],
    arch: _Architecture,
    config: dict[str, Any],
) -> Iterable[_Entry]:
    """(HF name, shape, loader) triples; the loaders run one at a time while writing."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    def load(tensor: ReaderTensor) -> np.ndarray:
        weight = _dequantized(tensor)
        kind = tensor.name.split(".")[-2]
        if arch.qk_permuted and kind in heads:
            weight = unpermute_rotary(weight, heads[kind])
        return weight

    for name in sorted(names, key=lambda n: names[n]):
        tensor = tensors[name]
        yield names[name], _shape(tensor), lambda t=tensor: load(t)


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute(weights, n_head)`` on the rows of a q/k projection.

    Within one head HF keeps the two rotary halves apart, llama.cpp interleaves them:

        HF    rows  x0 x1 .. x(d/2-1) y0 y1 .. y(d/2-1)
        GGUF  rows  x0 y0 x1 y1 .. x(d/2-1) y(d/2-1)
    """
    head_dim = weight.shape[0] // num_heads
    split = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _shape(tensor: ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dims fastest-first: [in_features, out_features] is a torch [out, in] weight.
    return tuple(int(d) for d in reversed(tensor.shape))


def _dequantized(tensor: ReaderTensor) -> np.ndarray:
    return dequantize(tensor.data, tensor.tensor_type).reshape(_shape(tensor))


def _write_safetensors(path: Path, entries: Iterable[_Entry]) -> None:
    """Write float32 tensors in safetensors format, holding one tensor in memory at a time."""
    entries = list(entries)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        size = 4 * int(np.prod(shape))
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes with spaces
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, load in entries:
            array = np.ascontiguousarray(load(), dtype="<f4")
            if array.shape != shape:
                raise ValueError(f"{name}: dequantized to {array.shape}, expected {shape}")
            f.write(memoryview(array).cast("B"))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _f32(value: float) -> float:
    """A GGUF float32 as the short decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


# --- tokenizer: tokenizer.json rebuilt from llama.cpp's tokenizer.ggml.* metadata -------------

# llama.cpp's token types (llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _ByteLevelSplit:
    """How text is cut into words before byte-level BPE (llama.cpp's llama-vocab.cpp)."""

    regex: str | None  # None: GPT-2's own regex, applied by ByteLevel itself
    individual_digits: bool = False
    # Take a word the vocabulary has whole before trying merges (llama.cpp and HF Llama 3 do).
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        if self.regex is not None:
            return pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(self.regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])  # fmt: skip
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if self.individual_digits:
            return pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        return byte_level


_GPT2 = _ByteLevelSplit(None)
_STARCODER = _ByteLevelSplit(None, individual_digits=True)
_LLAMA3 = _ByteLevelSplit(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_QWEN2 = _ByteLevelSplit(_QWEN2_SPLIT)
# tokenizer.ggml.pre -> split. A value not listed is refused rather than guessed: a wrong split
# still tokenizes, just into ids the model was not trained on.
BYTE_LEVEL_PRE = {
    "gpt2": _GPT2,
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


def _build_tokenizer(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """tokenizer.json (as a `tokenizers.Tokenizer`) and tokenizer_config.json contents."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError("GGUF has no tokenizer.ggml.tokens")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)

    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre")
        split = BYTE_LEVEL_PRE.get(pre)  # type: ignore[arg-type]
        if split is None:
            raise ValueError(
                f"byte-level tokenizer with tokenizer.ggml.pre={pre!r} is not supported "
                f"(supported: {', '.join(sorted(BYTE_LEVEL_PRE))})"
            )
        tokenizer = Tokenizer(models.BPE(vocab, _merges(meta), ignore_merges=split.ignore_merges))
        tokenizer.pre_tokenizer = split.pre_tokenizer()
        tokenizer.decoder = decoders.ByteLevel()
        default_add_bos = split.add_bos
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens, vocab)
        default_add_bos = True
    else:
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama)")

    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    # Added tokens are matched whole in the raw text before any splitting. Their ids come from
    # the vocabulary, which already holds them, so the vocabulary size does not change.
    tokenizer.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=True) if k in (_CONTROL, _UNKNOWN)
    ])  # fmt: skip
    tokenizer.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED
    ])  # fmt: skip

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    steps = [processors.ByteLevel(trim_offsets=False)] if kind == "gpt2" else []
    if add_bos or add_eos:
        first = [bos] if add_bos else []
        last = [eos] if add_eos else []
        steps.append(processors.TemplateProcessing(
            single=[*first, "$A", *last],
            pair=[*first, "$A", *last, *(f"{t}:1" for t in first), "$B:1", *(f"{t}:1" for t in last)],
            special_tokens=[(t, vocab[t]) for t in {*first, *last}],
        ))  # fmt: skip
    if steps:
        tokenizer.post_processor = steps[0] if len(steps) == 1 else processors.Sequence(steps)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        if (value := token(key)) is not None:
            config[name] = value
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer, config


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], vocab: dict[str, int]) -> Tokenizer:
    """llama.cpp's "llama" (SentencePiece BPE) vocabulary as HF's Llama fast tokenizer builds it."""
    if "tokenizer.ggml.merges" in meta:
        merges = _merges(meta)
    elif (scores := meta.get("tokenizer.ggml.scores")) is not None:
        merges = _merges_from_scores(tokens, scores, vocab)
    else:
        raise ValueError("SentencePiece GGUF tokenizer has neither merges nor scores")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(
        vocab, merges, unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True, byte_fallback=True,
    ))  # fmt: skip
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    merges = []
    for merge in meta.get("tokenizer.ggml.merges") or []:
        left, sep, right = merge.partition(" ")
        if not sep or " " in right:
            raise ValueError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        merges.append((left, right))
    return merges


def _merges_from_scores(
    tokens: list[str], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """SentencePiece files carry scores instead of merges. Every split of a token into two
    vocabulary pieces is a merge, ranked by the token's score: the recipe HF uses when it turns
    a slow SentencePiece tokenizer into a fast one."""
    ranked = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        pieces = [(token[:i], token[i:]) for i in range(1, len(token))]
        found = sorted(
            ((a, b) for a, b in pieces if a in vocab and b in vocab),
            key=lambda p: (vocab[p[0]], vocab[p[1]]),
        )
        ranked.extend((score, a, b) for a, b in found)
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(a, b) for _, a, b in ranked]
