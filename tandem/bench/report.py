"""Reports: a text summary, Markdown tables, JSON and PNG plots."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from tandem.bench.metrics import BenchmarkMetrics, RequestRecord

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))


def summary(m: BenchmarkMetrics, title: str) -> str:
    lines = [f"{f' {title} ':=^60}"]

    def row(name: str, value: object) -> None:
        lines.append(f"{name:<44}{value:>16}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", f"{m.duration_s:.2f}")
    row("Total input tokens:", m.input_tokens)
    row("Total output tokens:", m.output_tokens)
    row("Request throughput (req/s):", f"{m.request_throughput:.2f}")
    if m.goodput is not None:
        row("Goodput (req/s):", f"{m.goodput:.2f}")
    row("Output token throughput (tok/s):", f"{m.output_throughput:.2f}")
    row("Total token throughput (tok/s):", f"{m.total_token_throughput:.2f}")
    for key, name in LATENCIES:
        s = getattr(m, key)
        lines.append(f"{f' {name} (ms) ':-^60}")
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize()} {name}:", f"{getattr(s, stat):.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def to_dict(m: BenchmarkMetrics) -> dict:
    return dataclasses.asdict(m)


def record_dict(r: RequestRecord) -> dict:
    """Per-request timings, relative to the request's start, for the JSON."""
    return {"prompt_len": r.prompt_len, "output_tokens": r.output_tokens, "ok": r.ok,
            "error": r.error or None, "ttft_s": r.ttft if r.ok else None,
            "e2e_s": r.e2e, "tpot_s": r.tpot if r.ok else None,
            "chunk_offsets_s": [t - r.start for t in r.chunk_times],
            "chunk_tokens": r.chunk_tokens}


def write_json(path: Path, payload: dict) -> None:
    def clean(x):  # JSON has no NaN or infinity
        if isinstance(x, float) and not math.isfinite(x):
            return None if math.isnan(x) else str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(payload), indent=2) + "\n")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latencies(series: dict[str, list[RequestRecord]], path: Path) -> None:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E, one line per series."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    for ax, (key, name) in zip(axes.flat, LATENCIES):
        for label, records in series.items():
            done = [r for r in records if r.ok]
            values = {"ttft": [r.ttft for r in done],
                      "tpot": [t for r in done if (t := r.tpot) is not None],
                      "itl": [x for r in done for x in r.itls],
                      "e2e": [r.e2e for r in done]}[key]
            ms = sorted(v * 1000 for v in values)
            if ms:
                ax.step([ms[0], *ms], [0.0, *((i + 1) / len(ms) for i in range(len(ms)))],
                        where="post", label=label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of tokens")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Latency distributions (CDF)")
    fig.tight_layout()
    _save(fig, path, plt)


def plot_throughput(series: dict[str, list[tuple[str, BenchmarkMetrics]]], path: Path) -> None:
    """Output token and request throughput against the offered request rate
    (``series``: label -> [(rate label, metrics)], in sweep order)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for label, points in series.items():
        xs = list(range(len(points)))
        left.plot(xs, [m.output_throughput for _, m in points], marker="o", label=label)
        right.plot(xs, [m.request_throughput for _, m in points], marker="o", label=label)
        for ax in (left, right):
            ax.set_xticks(xs, [rate for rate, _ in points])
    left.set_ylabel("output tokens / s")
    right.set_ylabel("completed requests / s")
    for ax in (left, right):
        ax.set_xlabel("offered request rate (req/s)")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle("Throughput against request rate")
    fig.tight_layout()
    _save(fig, path, plt)


def _save(fig, path: Path, plt) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
