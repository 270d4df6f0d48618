"""Speculative decoding's configuration, with vLLM's keys (engine/spec_decode/ does it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SPEC_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
              "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's keys: ``{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min":
    2}`` or ``{"model": "path", "num_speculative_tokens": k}`` (a draft
    model; ``method`` is then "draft_model"). engine/spec_decode/ does it."""

    num_speculative_tokens: int
    method: str = "ngram"
    # The draft model's directory (method "draft_model").
    model: str | None = None
    # n-gram: match the last n tokens, n from max down to min.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; choose {', '.join(SPEC_METHODS)}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs a draft \"model\"")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("n-gram speculation takes no draft \"model\"")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
                raise ValueError(
                    f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got {lo} and {hi}"
                )

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {spec!r}")
        unknown = sorted(set(spec) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {unknown}; known: {', '.join(_SPEC_KEYS)}"
            )
        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config needs num_speculative_tokens")
        spec = dict(spec)
        spec.setdefault("method", "draft_model" if spec.get("model") else "ngram")
        return cls(**spec)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """From a ``--speculative-config`` flag's JSON."""
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        return cls.from_dict(spec)
