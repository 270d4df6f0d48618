"""Speculative decoding's acceptance as a server reports it on ``/metrics``.

vLLM and Tandem's workers both export ``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens`` and ``..._num_accepted_tokens`` (counters: the text
format names their samples ``..._total``). ``tandem bench serve`` reads them
before and after a run and reports the difference; a server without them
(no speculation, or a gateway that does not aggregate its workers') gives
None and nothing is reported.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

_NAMES = {"drafts": "vllm:spec_decode_num_drafts",
          "draft_tokens": "vllm:spec_decode_num_draft_tokens",
          "accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}


@dataclass(frozen=True)
class SpecCounts:
    drafts: float
    draft_tokens: float
    accepted_tokens: float

    def __sub__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                          self.accepted_tokens - other.accepted_tokens)

    def summary(self) -> dict[str, float] | None:
        """Acceptance rate and mean accepted length, or None without proposals."""
        if not self.drafts or not self.draft_tokens:
            return None
        return {"num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted_tokens,
                "acceptance_rate": self.accepted_tokens / self.draft_tokens,
                "mean_accepted_length": 1 + self.accepted_tokens / self.drafts}


def parse(text: str) -> SpecCounts | None:
    """The three counters from Prometheus text, summed over labels; None if absent."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([^\s{#]+)(?:\{[^}]*\})?\s+(\S+)$", line)
        if not m:
            continue
        name = m.group(1).removesuffix("_total")
        for key, metric in _NAMES.items():
            if name == metric:
                found[key] = found.get(key, 0.0) + float(m.group(2))
    if len(found) < len(_NAMES):
        return None
    return SpecCounts(**found)


def scrape(url: str, timeout: float = 5.0) -> SpecCounts | None:
    """The counters at ``url`` (a /metrics address); None if unreachable or absent."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return parse(r.read().decode())
    except (OSError, ValueError):
        return None
