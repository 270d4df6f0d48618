"""Goodput of --disagg-policy always, never and auto on a mixed workload.

    PYTHONPATH=. python benchmarks/disagg_policy.py [--rounds 3] [--num-prompts 16]
        [--short-len 64] [--long-len 1024] [--long-fraction 0.2] [--output-len 32]
        [--request-rate 1.0] [--goodput ttft:2000 tpot:150] [--transport mooncake]

One cluster: 1 prefill and 1 decode worker (the bundled SmolLM2), each on
its own half of the cores and lending it to the other while idle or under a
prefill backlog, as ``tandem up`` places them (``--no-lend-cores``: as
``tandem up --no-lend-cores``), and three gateways
in front of the same two workers, one per policy. Each round sends the same
request stream (``tandem bench serve --dataset mixed``: Poisson arrivals,
most prompts short and a fraction long, random token ids) through each
gateway in turn, the order rotating from round to round, so that a change in
the machine's load hits the policies alike. The workers run without prefix
caching: the policies send the same prompts, and the ones after the first
would otherwise find them cached.

Per policy over all rounds: goodput (requests that met every SLO per second
of benchmark time), TTFT and TPOT medians and p90 of the short and the long
prompts, and where the prompts were computed (the gateway's
``tandem:disagg_decisions``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.cluster import ROOT, LocalCluster  # noqa: E402

POLICIES = ("always", "never", "auto")


def serve(url: str, args, seed: int, label: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--url", url,
           "--dataset", "mixed", "--num-prompts", str(args.num_prompts),
           "--random-input-len", str(args.short_len), "--mixed-long-len", str(args.long_len),
           "--mixed-long-fraction", str(args.long_fraction),
           "--random-output-len", str(args.output_len), "--vocab-size", "49152",
           "--request-rate", str(args.request_rate), "--seed", str(seed),
           "--goodput", *args.goodput, "--result-dir", str(out), "--label", label,
           "--no-progress"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads((out / f"{label}.json").read_text())


def decisions(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tandem:disagg_decisions_total{"):
            where = line.split('where="')[1].split('"')[0]
            out[where] = out.get(where, 0) + float(line.rsplit(" ", 1)[1])
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--short-len", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--long-fraction", type=float, default=0.2)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=1.0)
    ap.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:150"],
                    metavar="KEY:MS")
    ap.add_argument("--transport", default="mooncake", choices=["grpc", "torch", "mooncake"])
    ap.add_argument("--kv-cache-gib", default="0.5")
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--lend-cores", action=argparse.BooleanOptionalAction, default=True,
                    help="workers lend each other their cores, as tandem up's")
    args = ap.parse_args()

    from engine.loader.resolve import resolve_model_dir
    from worker.cpu_cores import placement_flags, split_cores

    model_dir = resolve_model_dir(args.model)
    cores = split_cores(2)
    pin = placement_flags(cores, args.lend_cores) if cores else [[], []]
    wire = "mooncake,grpc" if args.transport == "mooncake" else args.transport
    # NOTE: no prefix caching: every policy sends the same prompts, which the
    # workers would otherwise serve from the cache after the first policy.
    common = ["--model", str(model_dir), "--kv-cache-gib", args.kv_cache_gib,
              "--transport", wire, "--no-prefix-caching"]
    slos = {k: float(v) for k, v in (s.split(":") for s in args.goodput)}
    results: dict[str, list[dict]] = {p: [] for p in POLICIES}
    with tempfile.TemporaryDirectory() as tmp, LocalCluster() as cluster:
        prefill = cluster.start("prefill", [*common, *pin[0]])
        decode = cluster.start("decode", [*common, *pin[1]])
        gateways = {}
        for policy in POLICIES:
            gw = cluster.start("gateway", [
                "--model", str(model_dir), "--port", "0", "--transport", args.transport,
                "--prefill", prefill.address, "--decode", decode.address,
                "--disagg-policy", policy])
            gateways[policy] = (f"http://{gw.address}", f"http://{gw.address}/metrics")
        print(f"cores: prefill {cores[0] if cores else 'all'}, decode "
              f"{cores[1] if cores else 'all'}{', lent' if cores and args.lend_cores else ''}; "
              f"transport {args.transport}", flush=True)
        for r in range(args.rounds):
            order = POLICIES[r % 3:] + POLICIES[:r % 3]
            for policy in order:
                url, _ = gateways[policy]
                out = serve(url, args, seed=r, label=f"{policy}-{r}", out=Path(tmp))
                results[policy].append(out["runs"][0])
                m = out["runs"][0]["metrics"]
                print(f"  round {r} {policy:>6}: goodput {m['goodput']:.2f} req/s, "
                      f"{m['completed']} done in {m['duration_s']:.1f} s", flush=True)
        where = {p: decisions(gateways[p][1]) for p in POLICIES}

    print(f"\n{args.rounds} rounds x {args.num_prompts} requests per policy; prompts "
          f"{args.short_len} or {args.long_len} tokens ({args.long_fraction:.0%} long), "
          f"{args.output_len} output tokens, {args.request_rate:g} req/s Poisson; SLO "
          + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()))
    head = (f"{'policy':>7} | {'goodput req/s':>13} | {'met SLO':>8} | {'TTFT short p50/p90':>19}"
            f" | {'TTFT long p50/p90':>18} | {'TPOT p50/p90':>13} | {'local/remote':>12}")
    print(head)
    print("-" * len(head))
    for policy in POLICIES:
        runs = results[policy]
        reqs = [q for run in runs for q in run["requests"]]
        ok = [q for q in reqs if q["ok"]]
        met = [q for q in ok if q["ttft_s"] * 1e3 <= slos.get("ttft", float("inf"))
               and (q["tpot_s"] or 0) * 1e3 <= slos.get("tpot", float("inf"))]
        duration = sum(run["metrics"]["duration_s"] for run in runs)
        short = [q["ttft_s"] * 1e3 for q in ok if q["prompt_len"] < args.long_len]
        long = [q["ttft_s"] * 1e3 for q in ok if q["prompt_len"] >= args.long_len]
        tpot = [q["tpot_s"] * 1e3 for q in ok if q["tpot_s"]]
        w = where[policy]

        def pair(xs: list[float]) -> str:
            return f"{statistics.median(xs):.0f} / {percentile(xs, 0.9):.0f}" if xs else "-"

        print(f"{policy:>7} | {len(met) / duration:>13.2f} | {len(met):>3}/{len(reqs):<4} | "
              f"{pair(short):>19} | {pair(long):>18} | {pair(tpot):>13} | "
              f"{w.get('local', 0):>5.0f}/{w.get('remote', 0):<6.0f}")


if __name__ == "__main__":
    main()
