"""Benchmark request streams: what each request sends and how many tokens it
asks for. Every generator is a pure function of its arguments and seed, so
two runs with the same flags send the same requests (``stream_hash`` proves
it).

- ``random``: random token ids; input and output lengths drawn uniformly
  from ``[len * (1 - range_ratio), len * (1 + range_ratio)]``.
- ``shared-prefix``: ``num_prefixes`` random prefixes, each request one of
  them plus a random suffix, in shuffled order (exercises prefix caching).
- ``mixed``: random token ids, most prompts short and a fraction long
  (where to prefill matters: ``--disagg-policy``); each request is long with
  probability ``long_fraction``, lengths as for ``random``.
- ``sharegpt``: first human turn of ShareGPT-style conversations from a local
  JSON file as the text prompt; the reply's token length as the output
  length, unless fixed.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

# NOTE: random prompts avoid the low ids, where most vocabularies keep their
# special tokens (BOS, EOS, chat markers).
FIRST_PLAIN_TOKEN = 100


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | tuple[int, ...]  # text, or token ids
    prompt_len: int  # in tokens
    output_len: int  # max_tokens to ask for

    @property
    def prompt_json(self) -> str | list[int]:
        return self.prompt if isinstance(self.prompt, str) else list(self.prompt)


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def _tokens(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(n))


def _check(num: int, vocab_size: int, **lengths: int) -> None:
    if num < 1:
        raise ValueError("need at least one prompt")
    if vocab_size <= FIRST_PLAIN_TOKEN:
        raise ValueError(f"vocab size must exceed {FIRST_PLAIN_TOKEN}, got {vocab_size}")
    for name, value in lengths.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    vocab_size: int = 32000, seed: int = 0) -> list[BenchRequest]:
    _check(num, vocab_size, input_len=input_len, output_len=output_len)
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in, n_out = _lengths(rng, input_len, range_ratio), _lengths(rng, output_len,
                                                                       range_ratio)
        out.append(BenchRequest(_tokens(rng, n_in, vocab_size), n_in, n_out))
    return out


def mixed_requests(num: int, short_len: int, long_len: int, long_fraction: float,
                   output_len: int, range_ratio: float = 0.0, vocab_size: int = 32000,
                   seed: int = 0) -> list[BenchRequest]:
    _check(num, vocab_size, input_len=short_len, long_len=long_len, output_len=output_len)
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"the long fraction must be in [0, 1], got {long_fraction}")
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        mean = long_len if rng.random() < long_fraction else short_len
        n_in, n_out = _lengths(rng, mean, range_ratio), _lengths(rng, output_len, range_ratio)
        out.append(BenchRequest(_tokens(rng, n_in, vocab_size), n_in, n_out))
    return out


def shared_prefix_requests(num: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                           output_len: int, vocab_size: int = 32000,
                           seed: int = 0) -> list[BenchRequest]:
    _check(num, vocab_size, num_prefixes=num_prefixes, prefix_len=prefix_len,
           suffix_len=suffix_len, output_len=output_len)
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    out = [BenchRequest(prefixes[i % num_prefixes] + _tokens(rng, suffix_len, vocab_size),
                        prefix_len + suffix_len, output_len) for i in range(num)]
    rng.shuffle(out)
    return out


def sharegpt_requests(path: str | Path, num: int, tokenizer_dir: str | Path,
                      output_len: int | None = None, seed: int = 0,
                      max_prompt_len: int = 1024, max_total_len: int = 2048
                      ) -> list[BenchRequest]:
    """Conversations shorter than 4 tokens on either side, or longer than the
    limits, are skipped (as vLLM does)."""
    from engine.tokenizer import Tokenizer

    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    tokenizer = Tokenizer(tokenizer_dir)
    convs = [d.get("conversations") or d.get("conversation") for d in data
             if isinstance(d, dict)]
    pairs = [(c[0]["value"], c[1]["value"]) for c in convs if c and len(c) >= 2]
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        n_in = len(tokenizer.encode(prompt))
        n_out = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if n_in < 4 or n_out < 4 or n_in > max_prompt_len or n_in + n_out > max_total_len:
            continue
        out.append(BenchRequest(prompt, n_in, n_out))
        if len(out) == num:
            return out
    raise ValueError(f"{path}: only {len(out)} usable conversations, {num} requested")


def stream_hash(requests: list[BenchRequest], offsets: list[float] | None = None) -> str:
    """A short digest of what is sent and when (to the microsecond)."""
    h = hashlib.sha256()
    for r in requests:
        h.update(json.dumps([r.prompt_json, r.output_len]).encode())
    for t in offsets or []:
        h.update(f"{t:.6f}".encode())
    return h.hexdigest()[:16]
