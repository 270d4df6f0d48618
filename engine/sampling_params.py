"""How to sample one request. Torch-free: the gateway validates with it too."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MIN_TEMPERATURE = 0.01  # a smaller positive temperature is raised to it


@dataclass
class SamplingParams:
    """Sampling settings with vLLM's names and meanings.

    Every invalid value raises ``ValueError`` at construction, before any
    block is allocated. A positive ``temperature`` under 0.01 is raised to
    0.01, as vLLM does.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context (resolved by the engine)
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # False: token ids only; the outputs' text stays empty.
    detokenize: bool = True
    # vLLM's setting for slow tokenizers; Tandem's (fast) tokenizers decode
    # special tokens without spaces between them, as vLLM's fast path does.
    spaces_between_special_tokens: bool = True
    # A grammar the output must match (JSON Schema, regex, choice...); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # Token id -> added to its logit before sampling, in [-100, 100] (OpenAI's).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled; None: any.
    allowed_token_ids: list[int] | None = None
    # Words that may not be generated: the last token of a word (with or
    # without a leading space) is banned where the tokens before it end the
    # output so far (as in vLLM).
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:  # a key it does not have
                raise ValueError(f"structured_outputs: {exc}") from None
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs must be a StructuredOutputsParams")
        self.stop = _listed(self.stop, "stop", str)
        self.stop_token_ids = _listed(self.stop_token_ids, "stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):  # vLLM's reading: True is 1
                setattr(self, name, int(getattr(self, name)))
        # NumPy's and other libraries' scalars, as plain numbers.
        for name in _INTEGERS:
            value = _plain(getattr(self, name), int)
            _check((value is None and name in _MAY_BE_NONE)
                   or (isinstance(value, int) and not isinstance(value, bool)),
                   f"{name} must be an integer, got {value!r}")
            setattr(self, name, value)
        for name in _REALS:
            setattr(self, name, _plain(getattr(self, name), float))
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int)
                                        and self.max_tokens >= 1),
            f"max_tokens must be at least 1 (or None), got {self.max_tokens}",
        )
        _check(
            isinstance(self.min_tokens, int)
            and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            # NOTE: float32's range: the workers' wire format (common.proto) carries float32.
            _check(isinstance(value, int | float) and math.isfinite(value)
                   and abs(value) <= _FLOAT32_MAX,
                   f"{name} must be a finite number, got {value!r}")
        _check(self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # Logits divided by 1e-38 overflow to inf and sample garbage; so
            # small a temperature means "nearly greedy" (as vLLM takes it).
            logger.warning("temperature %g raised to %g", self.temperature, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}",
        )
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0,
            f"repetition_penalty must be positive, got {self.repetition_penalty}",
        )
        _check(
            -2 <= self.presence_penalty <= 2,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        _check(self.detokenize or not self.stop,
               "stop strings need detokenize=True: they are matched in the text")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and 0 <= value <= 20),
                f"{name} must be in [0, 20], got {value}",
            )
        _check(
            self.seed is None or isinstance(self.seed, int), f"seed must be an int, got {self.seed!r}"
        )
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, Mapping),
                   f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
            self.logit_bias = dict(self.logit_bias)
            for token, bias in self.logit_bias.items():
                _check(isinstance(token, int) and not isinstance(token, bool)
                       and 0 <= token <= _UINT32_MAX,
                       f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                _check(isinstance(bias, int | float) and -100 <= bias <= 100,
                       f"logit_bias values must be in [-100, 100], got {bias!r}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _listed(self.allowed_token_ids, "allowed_token_ids")
            _check(bool(self.allowed_token_ids) and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _UINT32_MAX
                for t in self.allowed_token_ids),
                f"allowed_token_ids must be a non-empty list of token ids, "
                f"got {self.allowed_token_ids}")
        if self.bad_words is not None:
            self.bad_words = _listed(self.bad_words, "bad_words", str)
            _check(all(isinstance(w, str) and w.strip() for w in self.bad_words),
                   "bad_words must be non-empty strings")
        # The integers' ranges: the workers' wire format (common.proto) carries them
        # (n's is max_n, which check_request holds it to).
        for name, low, high in (("max_tokens", 1, _UINT32_MAX),
                                ("min_tokens", 0, _UINT32_MAX), ("top_k", -1, _INT32_MAX),
                                ("seed", -_INT64_MAX - 1, _INT64_MAX)):
            value = getattr(self, name)
            _check(value is None or low <= value <= high,
                   f"{name} must be in [{low}, {high}], got {value}")
        _check(all(isinstance(t, int) and 0 <= t <= _UINT32_MAX for t in self.stop_token_ids),
               f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def changes_logits(self) -> bool:
        """Penalties, a logit bias, allowed tokens or bad words: logits are
        changed row by row before sampling."""
        return (self.has_penalties or bool(self.logit_bias)
                or self.allowed_token_ids is not None or bool(self.bad_words))


_INTEGERS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs")
_MAY_BE_NONE = ("max_tokens", "seed", "logprobs", "prompt_logprobs")
_REALS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty")
_FLOAT32_MAX = 3.4028234663852886e38


def _plain(value: Any, kind: type) -> Any:
    """A scalar of another library (``numpy.int64(5)``) as ``kind``; anything
    else unchanged, for the checks to judge."""
    if isinstance(value, bool | kind) or value is None:
        return value
    if kind is int and isinstance(value, numbers.Integral):
        return int(value)
    if kind is float and isinstance(value, numbers.Real):
        return float(value)
    return value
_INT32_MAX, _UINT32_MAX, _INT64_MAX = 2**31 - 1, 2**32 - 1, 2**63 - 1


def _listed(value: Any, name: str, single: type | None = None) -> list:
    """``value`` as a new list (None: empty); one ``single`` alone (a stop
    string) is a list of it. ValueError for anything else, a mapping or a
    number, which ``list()`` would take apart or refuse with a TypeError."""
    if value is None:
        return []
    if single is not None and isinstance(value, single):
        return [value]
    _check(isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping),
           f"{name} must be a list, got {value!r}")
    return list(value)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
