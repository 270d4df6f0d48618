"""A Hugging Face fast tokenizer rebuilt from llama.cpp's ``tokenizer.ggml.*`` metadata.

Two vocabularies exist in GGUF files:

    tokenizer.ggml.model = "gpt2"   byte-level BPE; ``tokenizer.ggml.pre`` names the regex that
                                    cuts text into words first (see BYTE_LEVEL_PRE)
    tokenizer.ggml.model = "llama"  SentencePiece BPE with byte fallback; merges, or scores that
                                    merges are derived from

Control and user-defined tokens become added tokens, so they are matched whole in raw text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

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


def build_tokenizer(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
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
