"""Shared helpers for the engine tests: tiny models built once per test
process, a toy byte-level BPE tokenizer, engines, Hugging Face references.

Plain cached functions rather than conftest fixtures (tests/conftest.py is
shared with the kernel tests): a test module wraps them in module-scoped
fixtures where it wants them.
"""

from __future__ import annotations

import atexit
import functools
import json
import random
import shutil
import tempfile
from pathlib import Path

import torch
from tiny_models import TINY, build_tiny_model

EOS = TINY["eos_token_id"]  # 2
VOCAB = TINY["vocab_size"]  # 512

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@functools.cache
def root() -> Path:
    path = Path(tempfile.mkdtemp(prefix="tandem-engine-tests-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def tiny(name: str = "llama-gqa"):
    """(model_dir, hf_model) of a tiny random model, built once per process."""
    return build_tiny_model(name, root())


@functools.cache
def toy_tokenizer():
    """A byte-level BPE tokenizer with <unk>=0, <s>=1, </s>=2 (the tiny
    models' bos and eos), fewer than 512 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = (
        "the quick brown fox jumps over a lazy dog hello world héllo café naïve "
        "tandem server token block cache prefix decode prefill stream stop model "
        "engine batch paged attention kernel request sample greedy 🙂 日本"
    ).split()
    words += ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 6)))
              for _ in range(150)]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(600)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    assert tok.token_to_id("</s>") == EOS and tok.get_vocab_size() <= VOCAB
    return tok


def tiny_with_tokenizer(name: str = "llama-gqa") -> Path:
    """A copy of a tiny model directory with the toy tokenizer and a chat template."""
    # NOTE: one cache key per name, however it is passed: f() and f("llama-gqa")
    # are different functools.cache keys and would copy the directory twice.
    return _tiny_with_tokenizer(name)


@functools.cache
def _tiny_with_tokenizer(name: str) -> Path:
    src, _ = tiny(name)
    path = root() / f"{name}-tok"
    shutil.copytree(src, path)
    toy_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
    }))
    return path


def with_generation_config(dest: Path, **values) -> Path:
    """A copy at ``dest`` of the tiny model with a tokenizer, whose
    generation_config.json also sets ``values`` (sampling defaults)."""
    shutil.copytree(tiny_with_tokenizer(), dest)
    gen = dest / "generation_config.json"
    config = json.loads(gen.read_text()) if gen.is_file() else {}
    gen.write_text(json.dumps({**config, **values}))
    return dest


def tiny_llm():
    """The offline API over the tiny model with a tokenizer: float32, a
    256-token context, 128 blocks of 4."""
    from tandem import LLM

    return LLM(str(tiny_with_tokenizer()), dtype="float32", block_size=4, num_blocks=128,
               max_model_len=256)


def make_engine(model_dir: Path | str, **kwargs):
    from engine.llm_engine import LLMEngine
    from tandem.llm import engine_config

    kwargs.setdefault("num_blocks", 256)
    # float32 unless asked: the tests compare tokens with Hugging Face's float32.
    kwargs.setdefault("dtype", "float32")
    return LLMEngine(engine_config(str(model_dir), **kwargs))


def run_to_completion(engine, max_steps: int = 10_000) -> dict:
    """Step until idle; the final output of every request by id."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests(), "engine did not drain"
    return done


def record_steps(engine) -> list:
    """Every SchedulerOutput the engine hands its runner from now on (the
    plain-data boundary between scheduler and runner)."""
    seen = []
    execute = engine.runner.execute

    def recording(out):
        seen.append(out)
        return execute(out)

    engine.runner.execute = recording
    return seen


def assert_all_free(engine) -> None:
    """Every block is back in the free queue and no request is left anywhere."""
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_requests == stats.num_sequences == 0
    assert stats.num_running == stats.num_waiting == 0
    assert not engine.has_unfinished_requests()
    assert engine.runner.num_requests == 0  # the runner forgot them too


def random_prompts(lengths, seed: int = 0, low: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, VOCAB) for _ in range(n)] for n in lengths]


@torch.no_grad()
def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every position of ``token_ids``: [len, vocab]."""
    logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
