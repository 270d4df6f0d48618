"""What the gateway's API keys and request limits cost on the happy path.

Serves SmolLM2 colocated (`tandem up --prefill 0 --decode 1`) twice in
turn, arms interleaved so that a change in the machine's load hits both
alike, and drives each with the same seeded `tandem bench serve` workload:

- ``open``: no API key (the request limits are always on);
- ``keyed``: ``--api-key`` with three keys, every request checked against
  all three in constant time.

Then times, per request, what the limits and the key add in the gateway
itself (the key check, the body check), to set against the latencies.

    PYTHONPATH=. .venv/bin/python benchmarks/gateway_overhead.py [--reps 3]

Prints a table (median over repetitions of each arm's output tok/s, TTFT
p50, TPOT p50, E2E p50) and writes the raw results under --result-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEYS = "first-bench-key,second-bench-key,bench-key"
KEY = "bench-key"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int, key: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--prefill", "0", "--decode", "1",
           "--port", str(port)]
    if key:
        cmd += ["--api-key", KEYS]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers,
                         timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise RuntimeError("the server did not come up")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, 15)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def bench(port: int, key: str | None, out: Path, label: str, args) -> dict:
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve",
           "--url", f"http://127.0.0.1:{port}", "--num-prompts", str(args.num_prompts),
           "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--request-rate", args.request_rate, "--seed", "0",
           "--result-dir", str(out), "--label", label, "--no-progress", "--warmup", "4"]
    if key:
        cmd += ["--api-key", key]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    metrics = json.loads((out / f"{label}.json").read_text())["runs"][0]["metrics"]
    return metrics


def per_request_costs() -> dict[str, float]:
    """Microseconds per request of the key check and the body check."""
    import timeit

    from gateway.auth import ApiKeys
    from gateway.request_guard import is_unicode_text

    keys = ApiKeys(KEYS)
    header = f"Bearer {KEY}"
    body = json.dumps({"model": "m", "prompt": "word " * 100, "max_tokens": 32,
                       "temperature": 0}).encode()
    n = 20000
    return {
        "key check (3 keys) us": min(timeit.repeat(lambda: keys.check(header), number=n,
                                                   repeat=5)) / n * 1e6,
        "body check us": min(timeit.repeat(lambda: is_unicode_text(body), number=n,
                                           repeat=5)) / n * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--result-dir", type=Path,
                   default=ROOT / "bench_results" / "gateway_overhead")
    args = p.parse_args()
    args.result_dir.mkdir(parents=True, exist_ok=True)
    arms = {"open": None, "keyed": KEY}
    results: dict[str, list[dict]] = {name: [] for name in arms}
    for rep in range(args.reps):
        for name, key in arms.items():
            port = free_port()
            proc = serve(port, key)
            try:
                load = os.getloadavg()[0]
                m = bench(port, key, args.result_dir, f"{name}-{rep}", args)
                m["load"] = load
                results[name].append(m)
                print(f"rep {rep} {name}: {m['output_throughput']:.1f} tok/s, "
                      f"TTFT p50 {m['ttft']['median']:.0f} ms, "
                      f"TPOT p50 {m['tpot']['median']:.1f} ms, load {load:.1f}", flush=True)
            finally:
                stop(proc)
    costs = per_request_costs()
    (args.result_dir / "summary.json").write_text(json.dumps(
        {"arms": results, "per_request": costs}, indent=2))
    print("\n| arm | output tok/s | TTFT p50 ms | TPOT p50 ms | E2E p50 ms | failed |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        tps, ttft, tpot, e2e = (statistics.median(f(r) for r in runs) for f in (
            lambda r: r["output_throughput"], lambda r: r["ttft"]["median"],
            lambda r: r["tpot"]["median"], lambda r: r["e2e"]["median"]))
        print(f"| {name} | {tps:.1f} | {ttft:.0f} | {tpot:.1f} | {e2e:.0f} | "
              f"{sum(r['failed'] for r in runs)} |")
    for what, us in costs.items():
        print(f"{what}: {us:.2f}")


if __name__ == "__main__":
    main()
