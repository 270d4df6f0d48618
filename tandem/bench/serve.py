"""``tandem bench serve``: load-test a running server.

    tandem bench serve --url http://127.0.0.1:8000 --dataset random \\
        --random-input-len 128 --random-output-len 64 --request-rate 1,2,4 \\
        --goodput ttft:500 tpot:100

``--url grpc://HOST:PORT`` drives Tandem's gRPC Generate instead of
``/v1/completions``. One run per request rate; prints a summary for each and
writes ``<label>.json``, ``<label>-latency.png`` and ``<label>-throughput.png``
under ``--result-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.bench import spec_metrics
from tandem.bench.arrivals import arrival_offsets, parse_rates, rate_label
from tandem.bench.datasets import (
    BenchRequest,
    mixed_requests,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
    stream_hash,
)
from tandem.bench.metrics import DEFINITIONS, BenchmarkMetrics, compute_metrics, parse_slos

if TYPE_CHECKING:  # NOTE: httpx, grpc and tqdm load when a benchmark runs, not for --help
    from tandem.bench.clients import Client
    from tandem.bench.runner import RunResult


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load-test a running OpenAI-compatible or gRPC server",
                       description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="http(s)://HOST:PORT (OpenAI /v1/completions) or grpc://HOST:PORT "
                        "(Tandem Generate); default %(default)s")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--api-key", default=None)
    add_dataset_args(p)
    add_load_args(p)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (output lengths are then not exact)")
    p.add_argument("--warmup", type=int, default=1,
                   help="short requests sent first and not measured (default 1)")
    p.add_argument("--metrics-url", default=None,
                   help="Prometheus /metrics to read speculative decoding's acceptance from "
                        "before and after the run (default: the server's own /metrics for "
                        "http URLs; for Tandem, a decode worker's --metrics-port)")
    p.add_argument("--result-dir", type=Path, default=Path("bench_results"))
    p.add_argument("--label", default="serve", help="file name prefix for the results")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(run=run)


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", default="random",
                   choices=["random", "sharegpt", "shared-prefix", "mixed"])
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--seed", type=int, default=0,
                   help="same seed and flags: the same requests at the same times")
    g.add_argument("--vocab-size", type=int, default=32000,
                   help="random token ids are drawn below this (default %(default)s)")
    g.add_argument("--random-input-len", type=int, default=128)
    g.add_argument("--random-output-len", type=int, default=64)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in len*(1-r)..len*(1+r)")
    g.add_argument("--sharegpt-path", type=Path, default=None,
                   help="local ShareGPT-style JSON file")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length (default: the reply's length)")
    g.add_argument("--tokenizer", default=None,
                   help="model directory whose tokenizer counts ShareGPT tokens "
                        "(default: the bundled SmolLM2)")
    g.add_argument("--mixed-long-len", type=int, default=1024,
                   help="mixed: the long prompts' length (short: --random-input-len)")
    g.add_argument("--mixed-long-fraction", type=float, default=0.2,
                   help="mixed: the chance that a prompt is long")
    g.add_argument("--num-prefixes", type=int, default=4)
    g.add_argument("--prefix-len", type=int, default=256)
    g.add_argument("--suffix-len", type=int, default=32)
    g.add_argument("--shared-prefix-output-len", type=int, default=64)


def add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default="inf",
                   help="requests/s, comma-separated for a sweep; inf sends all at once "
                        "(default %(default)s)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, <1 burstier")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")


def build_dataset(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.vocab_size, args.seed)
    if args.dataset == "mixed":
        return mixed_requests(args.num_prompts, args.random_input_len, args.mixed_long_len,
                              args.mixed_long_fraction, args.random_output_len,
                              args.random_range_ratio, args.vocab_size, args.seed)
    if args.dataset == "shared-prefix":
        return shared_prefix_requests(args.num_prompts, args.num_prefixes, args.prefix_len,
                                      args.suffix_len, args.shared_prefix_output_len,
                                      args.vocab_size, args.seed)
    if args.sharegpt_path is None:
        raise ValueError("--dataset sharegpt needs --sharegpt-path FILE")
    from engine.loader.resolve import resolve_model_dir

    return sharegpt_requests(args.sharegpt_path, args.num_prompts,
                             resolve_model_dir(args.tokenizer), args.sharegpt_output_len,
                             args.seed)


def warmup_requests(n: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    return random_requests(n, 16, 4, 0.0, vocab_size, seed + 1_000_003) if n > 0 else []


@dataclass
class RatePoint:
    rate: float
    stream_hash: str
    result: RunResult
    metrics: BenchmarkMetrics

    @property
    def rate_label(self) -> str:
        return rate_label(self.rate)


async def sweep(client: Client, requests: list[BenchRequest], rates: list[float],
                burstiness: float, seed: int, max_concurrency: int | None,
                slos: dict[str, float], progress: bool, name: str,
                echo: bool = True) -> list[RatePoint]:
    from tandem.bench.runner import run_stream

    points = []
    for rate in rates:
        offsets = arrival_offsets(len(requests), rate, burstiness, seed)
        digest = stream_hash(requests, offsets)
        if echo:
            print(f"{name}: {len(requests)} requests at {rate_label(rate)} req/s "
                  f"(burstiness {burstiness:g}), stream hash {digest}", flush=True)
        result = await run_stream(client, requests, offsets, max_concurrency, progress,
                                  desc=f"{name} @ {rate_label(rate)} req/s")
        points.append(RatePoint(rate, digest, result,
                                compute_metrics(result.records, result.duration_s, slos)))
    return points


def run(args: argparse.Namespace) -> int:
    from tandem.bench import report

    requests = build_dataset(args)
    rates = parse_rates(args.request_rate)
    slos = parse_slos(args.goodput)
    model = args.model or _served_model(args.url, args.api_key)
    print(f"dataset {args.dataset}: {len(requests)} requests, seed {args.seed}, "
          f"hash {stream_hash(requests)}")
    metrics_url = args.metrics_url or (f"{args.url.rstrip('/')}/metrics"
                                       if args.url.startswith("http") else None)
    spec_before = spec_metrics.scrape(metrics_url) if metrics_url else None
    points = asyncio.run(_run(args, model, requests, rates, slos))
    spec_after = spec_metrics.scrape(metrics_url) if spec_before is not None else None
    spec = (spec_after - spec_before).summary() if spec_after is not None else None
    for point in points:
        errors = [r.error for r in point.result.records if r.error]
        if errors:
            print(f"{len(errors)} failed; first error: {errors[0]}", file=sys.stderr)
        print(report.summary(point.metrics, f"{args.label} @ {point.rate_label} req/s"))
    if spec is not None:
        print(f"speculative decoding (all rates): acceptance {spec['acceptance_rate']:.2f}, "
              f"mean accepted length {spec['mean_accepted_length']:.2f} "
              f"({spec['num_accepted_tokens']:.0f} of {spec['num_draft_tokens']:.0f} "
              f"proposed tokens)")
    print(DEFINITIONS)
    out = args.result_dir
    report.write_json(out / f"{args.label}.json", {
        "args": {k: v if isinstance(v, int | float | bool | None) else str(v)
                 for k, v in vars(args).items() if k != "run"},
        "url": args.url, "model": model, "definitions": DEFINITIONS,
        "dataset": {"name": args.dataset, "num_prompts": len(requests), "seed": args.seed,
                    "hash": stream_hash(requests)},
        "spec_decode": spec,
        "slos_ms": slos, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "runs": [{"request_rate": p.rate_label, "stream_hash": p.stream_hash,
                  "metrics": report.to_dict(p.metrics),
                  "requests": [report.record_dict(r) for r in p.result.records]}
                 for p in points],
    })
    report.plot_latencies({f"{p.rate_label} req/s": p.result.records for p in points},
                          out / f"{args.label}-latency.png")
    report.plot_throughput({args.label: [(p.rate_label, p.metrics) for p in points]},
                           out / f"{args.label}-throughput.png")
    print(f"wrote {out / args.label}.json, {args.label}-latency.png, "
          f"{args.label}-throughput.png")
    return 0 if all(p.metrics.failed == 0 for p in points) else 1


async def _run(args, model, requests, rates, slos) -> list[RatePoint]:
    from tandem.bench.clients import make_client
    from tandem.bench.runner import send_sequentially

    client = make_client(args.url, model, args.api_key, args.temperature, args.ignore_eos)
    try:
        warm = await send_sequentially(client, warmup_requests(args.warmup, args.vocab_size,
                                                               args.seed))
        if any(r.error for r in warm):
            raise ValueError(f"warm-up request failed: {next(r.error for r in warm if r.error)}")
        return await sweep(client, requests, rates, args.burstiness, args.seed,
                           args.max_concurrency, slos, args.progress, args.label)
    finally:
        await client.close()


def _served_model(url: str, api_key: str | None) -> str | None:
    """The first model ``/v1/models`` lists; None (send no name) for gRPC or
    when the server does not say."""
    if not url.startswith("http"):
        return None
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/").removesuffix("/v1") + "/v1/models", headers=headers,
                      timeout=10)
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None
