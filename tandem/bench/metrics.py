"""Serving metrics, as pure functions over recorded timings.

A client records, per request, when it was sent, when each token-bearing
chunk of the response arrived (and how many tokens it carried), and when the
response ended. Everything below is derived from those records:

    start            chunk 0      chunk 1         chunk 2 (k=2)     end
      |----- TTFT ------|--- gap ----|------- gap ------|-------------|
      |---------------------------- E2E -------------------------------|

DEFINITIONS is printed with every report, so a reader never has to guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFINITIONS = (
    "TTFT: request sent -> first chunk that carries a token (non-empty text on OpenAI).\n"
    "E2E: request sent -> end of the response stream.\n"
    "TPOT: per request, (E2E - TTFT) / (output_tokens - 1); requests with one output "
    "token have none.\n"
    "ITL: gaps between consecutive token-bearing chunks; a chunk carrying k tokens "
    "contributes gap/k, k times (as vLLM). OpenAI chunks count as 1 token each.\n"
    "Percentiles interpolate linearly between ranks. Throughput and goodput divide by "
    "the run's duration (first request sent -> last response ended).\n"
    "Goodput: completed requests per second that met every SLO given with --goodput."
)


@dataclass
class RequestRecord:
    """What a client saw of one request. Times are ``time.perf_counter()``
    seconds; ``chunk_times`` and ``chunk_tokens`` have one entry per chunk
    that carried tokens."""

    prompt_len: int
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    usage_tokens: int | None = None  # completion tokens as the server counted them
    text: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else sum(self.chunk_tokens)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        out: list[float] = []
        for i in range(1, len(self.chunk_times)):
            gap = self.chunk_times[i] - self.chunk_times[i - 1]
            k = max(1, self.chunk_tokens[i])
            out.extend([gap / k] * k)
        return out


@dataclass(frozen=True)
class Stats:
    """Milliseconds."""

    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Stats:
        if not seconds:
            return cls(math.nan, math.nan, math.nan, math.nan)
        ms = [s * 1000.0 for s in seconds]
        return cls(sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    goodput: float | None  # requests / s meeting every SLO; None without SLOs
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """SLO keys: ttft, tpot, e2el (milliseconds). A request without a TPOT
    (one output token) meets any TPOT SLO."""
    measured = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2e}
    return all(measured[k] * 1000.0 <= limit for k, limit in slos_ms.items())


def compute_metrics(records: list[RequestRecord], duration_s: float,
                    slos_ms: dict[str, float] | None = None) -> BenchmarkMetrics:
    done = [r for r in records if r.ok]
    if duration_s <= 0:
        raise ValueError("duration must be positive")
    inputs = sum(r.prompt_len for r in done)
    outputs = sum(r.output_tokens for r in done)
    goodput = None
    if slos_ms:
        goodput = sum(meets_slos(r, slos_ms) for r in done) / duration_s
    return BenchmarkMetrics(
        completed=len(done), failed=len(records) - len(done), duration_s=duration_s,
        input_tokens=inputs, output_tokens=outputs,
        request_throughput=len(done) / duration_s, output_throughput=outputs / duration_s,
        total_token_throughput=(inputs + outputs) / duration_s, goodput=goodput,
        ttft=Stats.of([r.ttft for r in done]),
        tpot=Stats.of([t for r in done if (t := r.tpot) is not None]),
        itl=Stats.of([x for r in done for x in r.itls]),
        e2e=Stats.of([r.e2e for r in done]),
    )


def parse_slos(specs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}``."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        key, sep, value = spec.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {spec!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number") from None
        if slos[key] <= 0:
            raise ValueError(f"--goodput {spec!r}: the limit must be positive")
    return slos
