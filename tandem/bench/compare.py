"""``tandem bench compare``: Tandem disaggregated, Tandem colocated and a
Hugging Face ``generate`` baseline, on this machine, one arm at a time.

    tandem bench compare --request-rates 1,4,inf --num-prompts 12

Every arm gets the same request stream (printed hash). The Hugging Face arm
runs first: it is the reference for the correctness gate, which sends the
first ``--gate-prompts`` requests one at a time, greedy, to each arm and
requires the same text; an arm that fails ends the comparison before any
speed is reported. Then each arm runs the request-rate sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem.bench.arrivals import parse_rates
from tandem.bench.datasets import BenchRequest, random_requests, stream_hash
from tandem.bench.metrics import DEFINITIONS, RequestRecord, parse_slos
from tandem.bench.serve import RatePoint, sweep
from tandem.cluster import free_port

ARMS = {
    "hf": "HF generate, 1 at a time",
    "tandem-colocated": "Tandem colocated (1 worker)",
    "tandem-disagg": "Tandem disaggregated (1P+1D)",
}
HOST = "127.0.0.1"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="Tandem disaggregated vs colocated vs HF generate",
                       description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="tandem-disagg,tandem-colocated,hf",
                   help=f"comma-separated, from {', '.join(ARMS)} (hf is required: it is the "
                        "reference)")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rates", default="1,4,inf",
                   help="the sweep, requests/s (default %(default)s)")
    p.add_argument("--gate-prompts", type=int, default=4)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process, every arm (OMP_NUM_THREADS; default 1)")
    p.add_argument("--result-dir", type=Path, default=Path("bench_results"))
    p.add_argument("--label", default="compare")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(run=run)


@contextmanager
def start_arm(arm: str, model: str | None, kv_cache_gib: float,
              threads: int) -> Iterator[str]:
    """Start one arm; yields its OpenAI base URL; stops it on exit."""
    # NOTE: the same thread count for every process of every arm. On a small
    # machine shared with other work, OpenMP teams larger than the free cores
    # spin against each other, and the arm with fewer processes suffers most.
    env = {"OMP_NUM_THREADS": str(threads)}
    if arm == "hf":
        from tandem.bench.hf_baseline import hf_server

        with hf_server(model, HOST, free_port(), env=env) as url:
            yield url
        return
    from tandem.cluster import LocalCluster
    from tandem.up import start_cluster, up_args

    args = up_args(prefill=1 if arm == "tandem-disagg" else 0, decode=1, model=model,
                   host=HOST, port=free_port(), grpc_port=free_port(),
                   kv_cache_gib=kv_cache_gib, dtype="float32")
    with LocalCluster(env=env) as cluster:
        gateway = start_cluster(args, cluster)
        yield f"http://{gateway.address}"


def gate_mismatch(reference: list[RequestRecord], got: list[RequestRecord]) -> str | None:
    """None when every output matches the reference; else what differs."""
    for i, have in enumerate(got):
        if have.error:
            return f"request {i} failed: {have.error}"
    for i, (want, have) in enumerate(zip(reference, got)):
        if have.text != want.text:
            return f"request {i}: expected {want.text!r}, got {have.text!r}"
    return None


def parse_arms(spec: str) -> list[str]:
    arms = [a.strip() for a in spec.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm {unknown[0]!r}; choose from {', '.join(ARMS)}")
    if "hf" not in arms:
        raise ValueError("--arms must include hf: it is the correctness reference")
    # The reference runs first, so that a failing arm stops the run early.
    return ["hf", *dict.fromkeys(a for a in arms if a != "hf")]


def run(args: argparse.Namespace) -> int:
    arms = parse_arms(args.arms)
    rates = parse_rates(args.request_rates)
    slos = parse_slos(args.goodput)
    if args.threads < 1:
        raise ValueError("--threads must be at least 1")
    if not 0 <= args.gate_prompts <= args.num_prompts:
        raise ValueError("--gate-prompts must be between 0 and --num-prompts")
    requests = random_requests(args.num_prompts, args.input_len, args.output_len,
                               args.range_ratio, args.vocab_size, args.seed)
    print(f"{len(requests)} random requests (seed {args.seed}), hash {stream_hash(requests)}; "
          f"arms: {', '.join(arms)}; rates: {args.request_rates}", flush=True)
    began = time.monotonic()
    reference: list[RequestRecord] = []
    results: dict[str, list[RatePoint]] = {}
    for arm in arms:
        t0 = time.monotonic()
        with start_arm(arm, args.model, args.kv_cache_gib, args.threads) as url:
            print(f"[{arm}] up at {url} in {time.monotonic() - t0:.1f}s", flush=True)
            gate, points = asyncio.run(_exercise(arm, url, requests, rates, args, slos))
        print(f"[{arm}] " + ", ".join(
            f"{p.rate_label} req/s: {p.metrics.output_throughput:.1f} output tok/s"
            for p in points) + f" ({time.monotonic() - t0:.0f}s with start and stop)",
            flush=True)
        if arm == "hf":
            reference = gate
        problem = gate_mismatch(reference, gate)
        if problem:
            print(f"correctness gate FAILED for {arm} (greedy output differs from hf): "
                  f"{problem}\nno speed is reported.", file=sys.stderr)
            return 1
        print(f"[{arm}] correctness gate passed ({len(gate)} greedy outputs match hf)",
              flush=True)
        results[arm] = points
    table = comparison_table(results, arms)
    print(f"\n{table}\n\n{DEFINITIONS}\n(finished in {time.monotonic() - began:.0f}s)")
    _write(args, arms, requests, results, table)
    return 0


async def _exercise(arm: str, url: str, requests: list[BenchRequest], rates: list[float],
                    args: argparse.Namespace, slos: dict[str, float]
                    ) -> tuple[list[RequestRecord], list[RatePoint]]:
    """The gate (which also warms the arm up), then the sweep. The sweep is
    skipped when the gate fails: its numbers would not be reported."""
    from tandem.bench.clients import make_client
    from tandem.bench.runner import send_sequentially

    client = make_client(url, None, temperature=0.0, ignore_eos=True)
    try:
        gate = await send_sequentially(client, requests[: max(1, args.gate_prompts)])
        if any(r.error for r in gate):
            return gate, []
        points = await sweep(client, requests, rates, 1.0, args.seed, None, slos,
                             args.progress, arm)
        return gate[: args.gate_prompts], points
    finally:
        await client.close()


def _cell(value: float, base: float | None, digits: int = 1) -> str:
    if base is None or not base:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} ({value / base:.2f}x)"


def comparison_table(results: dict[str, list[RatePoint]], arms: list[str]) -> str:
    """One row per rate and arm; ratios (in brackets) are arm / hf."""
    from tandem.bench import report

    headers = ["rate (req/s)", "arm", "ok/failed", "output tok/s", "req/s", "TTFT p50 ms",
               "TTFT p99 ms", "TPOT p50 ms", "ITL p50 ms", "E2E p50 ms"]
    if any(p.metrics.goodput is not None for pts in results.values() for p in pts):
        headers.append("goodput req/s")
    rows = []
    for i, point in enumerate(results["hf"]):
        base = point.metrics
        for arm in [a for a in arms if a in results]:
            m = results[arm][i].metrics
            row = [point.rate_label, ARMS[arm], f"{m.completed}/{m.failed}",
                   _cell(m.output_throughput, base.output_throughput),
                   f"{m.request_throughput:.2f}",
                   _cell(m.ttft.median, base.ttft.median, 0),
                   _cell(m.ttft.p99, base.ttft.p99, 0),
                   _cell(m.tpot.median, base.tpot.median),
                   f"{m.itl.median:.1f}", _cell(m.e2e.median, base.e2e.median, 0)]
            if len(headers) > len(row):
                row.append(f"{m.goodput:.2f}")
            rows.append(row)
    return report.markdown_table(headers, rows) + "\n\nRatios in brackets: arm / hf."


def _write(args, arms, requests, results, table) -> None:
    from tandem.bench import report

    out, label = args.result_dir, args.label
    report.write_json(out / f"{label}.json", {
        "definitions": DEFINITIONS, "arms": {a: ARMS[a] for a in arms},
        "dataset": {"name": "random", "num_prompts": len(requests), "input_len": args.input_len,
                    "output_len": args.output_len, "range_ratio": args.range_ratio,
                    "seed": args.seed, "hash": stream_hash(requests)},
        "runs": {arm: [{"request_rate": p.rate_label, "stream_hash": p.stream_hash,
                        "metrics": report.to_dict(p.metrics)} for p in points]
                 for arm, points in results.items()},
    })
    (out / f"{label}.md").write_text(table + "\n")
    top = {ARMS[arm]: points[-1].result.records for arm, points in results.items()}
    report.plot_latencies(top, out / f"{label}-latency.png")
    report.plot_throughput({ARMS[arm]: [(p.rate_label, p.metrics) for p in points]
                            for arm, points in results.items()},
                           out / f"{label}-throughput.png")
    print(f"wrote {out / label}.json, .md, -latency.png (at {results['hf'][-1].rate_label} "
          f"req/s), -throughput.png")
