"""Speculative decoding (n-gram) through the gateway: ``tandem up`` + ``tandem bench serve``.

    PYTHONPATH=. python benchmarks/spec_decode_serve.py [--pairs 2]
        [--c1-prompts 8] [--c16-prompts 32] [--max-tokens 128]

Starts two ``tandem up --prefill 1 --decode 1`` clusters side by side (disaggregated: the
prefill worker only prefills, the decode worker decodes), one without speculation
(``off``) and one whose decode worker speculates (``on``) with ``--speculative-config
{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
"prompt_lookup_max": 4}``. Both stay up for the whole run and only one serves at a time
(an idle worker takes no CPU), so each cell is measured ``--pairs`` times on each arm,
alternating off, on, on, off, ...: a change in the machine's load within the run falls
on both arms alike. Each cluster first serves every workload once (16 prompts at
concurrency 16), not counted. The workloads, written here as ShareGPT-style JSON:

    hit      greedy chat prompts "Repeat the following text exactly: <paragraphs>"; the
             reply copies the prompt, so prompt lookups hit (stops at EOS)
    no-hit   chat prompts "Write a short story about <topic>" sampled at temperature 0.8
             (``ignore_eos``: every reply is --max-tokens long); lookups rarely hit

at ``--max-concurrency 1`` and ``16``. It prints each run as it ends, then per cell the
mean of each arm and on/off ratios: output tokens/s, TPOT p50, acceptance rate and mean
accepted length (read by ``tandem bench serve --metrics-url`` from the decode worker's
/metrics), the load average when the run started, and the decode worker's CPU seconds
per output token (from /proc/<pid>/stat): the machine may be shared, and CPU time per
token moves much less with other jobs than wall-clock numbers. The ratio column of a
cell also gives each pair's own CPU ratio, to show the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = {"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PARAGRAPHS = [
    "The harbour was quiet that evening. Two fishing boats rocked against the pier, and a "
    "gull stood on the lamp post as if it had been placed there to guard the nets.",
    "Before you start the machine, check that the water tank is full, the filter is clean, "
    "and the power cable is not bent or damaged anywhere along its length.",
    "Our library opens at nine on weekdays and at ten on Saturdays. Books may be borrowed "
    "for three weeks and renewed twice, unless another reader has reserved them.",
    "The recipe needs two cups of flour, one egg, a pinch of salt and enough milk to make "
    "a smooth batter. Let it rest for half an hour before you cook it.",
    "In the spring the valley turns green almost overnight. The snow on the peaks melts "
    "slowly, and the streams run fast and cold until the middle of June.",
    "The meeting will cover three topics: the new office layout, the holiday schedule for "
    "next year, and the plan to replace the old printers on the second floor.",
    "When the program starts, it reads the settings file, opens a connection to the "
    "database, and waits for requests on the port given in the settings.",
    "My grandmother kept a small garden behind the house, with beans along the fence, "
    "tomatoes by the wall, and a row of sunflowers that grew taller than the roof.",
    "The bus to the airport leaves every twenty minutes from the stop outside the main "
    "entrance. The ride takes about forty minutes when the roads are clear.",
    "A good password is long, hard to guess, and used for one account only. Store it in a "
    "password manager rather than on a note stuck to your screen.",
    "The museum's new wing shows maps from four centuries, from hand-drawn charts of the "
    "coast to the first printed atlas of the whole country.",
    "Each student must hand in the report by Friday at noon. Late reports lose ten points "
    "a day, and reports more than three days late are not accepted.",
]
TOPICS = [
    "a lighthouse keeper", "a lost umbrella", "a robot learning to paint", "a night train",
    "a small bakery", "a dragon afraid of heights", "two rival chess players",
    "a storm at sea", "an old clockmaker", "a city without cars", "a talking cat",
    "the last day of summer", "a map found in a book", "a broken violin",
    "a snowed-in village", "a first day at school",
]


def write_workloads(out: Path, num: int) -> dict[str, Path]:
    """ShareGPT-style JSON files of chat prompts (the model's chat template applied: the
    benchmark sends /v1/completions), ``num`` conversations each."""
    from engine.loader.resolve import resolve_model_dir
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_dir(None))
    rng = random.Random(0)

    def conv(user: str, reply: str) -> dict:
        text = tok.apply_chat_template([{"role": "user", "content": user}])
        return {"conversations": [{"from": "human", "value": text},
                                  {"from": "gpt", "value": reply}]}

    hit, nohit = [], []
    for i in range(num):
        paragraph = " ".join(rng.sample(PARAGRAPHS, 2))
        hit.append(conv(f"Repeat the following text exactly: {paragraph}", paragraph))
        topic = TOPICS[i % len(TOPICS)]
        nohit.append(conv(f"Write a short story about {topic}.", "Once upon a time " * 8))
    out.mkdir(parents=True, exist_ok=True)
    paths = {"hit": out / "hit.json", "no-hit": out / "nohit.json"}
    paths["hit"].write_text(json.dumps(hit, indent=1))
    paths["no-hit"].write_text(json.dumps(nohit, indent=1))
    return paths


def free_ports(n: int) -> int:
    """A base port with ``n`` consecutive free ports after it."""
    for _ in range(200):
        base = random.randrange(20000, 60000)
        try:
            socks = []
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


class Cluster:
    """One ``tandem up --prefill 1 --decode 1`` process and its decode worker."""

    def __init__(self, spec: bool, log: Path):
        base = free_ports(4)
        self.url = f"http://127.0.0.1:{base}"
        self.metrics_url = f"http://127.0.0.1:{base + 3}/metrics"  # prefill base+2, decode +3
        cmd = [sys.executable, "-m", "tandem.cli", "up", "--prefill", "1", "--decode", "1",
               "--port", str(base), "--grpc-port", str(base + 1),
               "--metrics-port", str(base + 2)]
        if spec:
            cmd.append(f"--worker-arg=--speculative-config={json.dumps(SPEC)}")
        self.log = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=ROOT)
        ready = False
        for line in self.proc.stdout:  # ends at EOF if tandem up exits
            self.log.write(line)
            if "Ctrl-C stops it" in line:
                ready = True
                break
        self.log.flush()
        if not ready:
            self.stop()
            raise RuntimeError(f"tandem up did not start; see {log}")
        self.decode_pid = self._decode_pid()

    def _decode_pid(self) -> int | None:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and b"decode" in cmdline:
                return int(stat.parent.name)
        return None

    def decode_cpu_s(self) -> float | None:
        """User + system CPU seconds of the decode worker so far."""
        if self.decode_pid is None:
            return None
        try:
            fields = Path(f"/proc/{self.decode_pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def bench(cluster: Cluster, workload: str, path: Path, conc: int, num: int, args,
          label: str) -> dict:
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--url", cluster.url,
           "--dataset", "sharegpt", "--sharegpt-path", str(path),
           "--sharegpt-output-len", str(args.max_tokens), "--num-prompts", str(num),
           "--max-concurrency", str(conc), "--request-rate", "inf",
           "--metrics-url", cluster.metrics_url, "--result-dir", str(args.result_dir),
           "--label", label, "--no-progress"]
    cmd += ["--temperature", "0", "--no-ignore-eos"] if workload == "hit" \
        else ["--temperature", "0.8"]
    load = os.getloadavg()[0]
    for attempt in range(3):
        cpu0 = cluster.decode_cpu_s()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        cpu1 = cluster.decode_cpu_s()
        if done.returncode == 0:
            break
        # NOTE: on a shared machine a starved worker can miss its heartbeats (a
        # request then fails); the run is measured again rather than lost.
        print(f"{label}: tandem bench serve failed (attempt {attempt + 1}): "
              f"{done.stdout[-300:]} {done.stderr[-300:]}", file=sys.stderr, flush=True)
    else:
        raise RuntimeError(f"tandem bench serve failed ({label})")
    result = json.loads((args.result_dir / f"{label}.json").read_text())
    m = result["runs"][0]["metrics"]
    spec = result["spec_decode"] or {}
    cpu = (cpu1 - cpu0) / m["output_tokens"] if None not in (cpu0, cpu1) else None
    return {"out_tok_s": m["output_throughput"], "tpot_p50_ms": m["tpot"]["median"],
            "output_tokens": m["output_tokens"], "load": load,
            "cpu_ms_per_token": None if cpu is None else cpu * 1000,
            "acceptance": spec.get("acceptance_rate"),
            "mean_accepted_len": spec.get("mean_accepted_length")}


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    lines = ["| workload | concurrency | arm | out tok/s | TPOT p50 ms | CPU ms/token "
             "| acceptance | mean accepted len | load |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        num = ".2f" if r["arm"].startswith("on/off") else ".1f"  # ratios: two decimals
        lines.append(f"| {r['workload']} | {r['concurrency']} | {r['arm']} "
                     f"| {fmt(r['out_tok_s'], num)} | {fmt(r['tpot_p50_ms'], num)} "
                     f"| {fmt(r['cpu_ms_per_token'], num)} | {fmt(r['acceptance'], '.2f')} "
                     f"| {fmt(r['mean_accepted_len'], '.2f')} | {fmt(r['load'], '.1f')} |")
    return "\n".join(lines)


def summarize(rows: list[dict]) -> list[dict]:
    """Per cell: the mean of each arm's runs, then on/off ratios of the means (tok/s,
    TPOT, CPU) and each pair's own CPU ratio."""
    out = []
    cells = dict.fromkeys((r["workload"], r["concurrency"]) for r in rows)
    keys = ("out_tok_s", "tpot_p50_ms", "cpu_ms_per_token", "acceptance",
            "mean_accepted_len", "load")
    for wl, conc in cells:
        mean, runs = {}, {}
        for arm in ("off", "on"):
            runs[arm] = [r for r in rows if (r["workload"], r["concurrency"], r["arm"]) ==
                         (wl, conc, arm)]
            if not runs[arm]:
                continue
            avg = {k: (sum(r[k] for r in runs[arm]) / len(runs[arm])
                       if all(r[k] is not None for r in runs[arm]) else None) for k in keys}
            mean[arm] = avg
            out.append({"workload": wl, "concurrency": conc,
                        "arm": f"{arm} (mean of {len(runs[arm])})", **avg})
        if len(mean) == 2:
            ratio = {k: None for k in keys}
            for k in ("out_tok_s", "tpot_p50_ms", "cpu_ms_per_token"):
                a, b = mean["on"][k], mean["off"][k]
                ratio[k] = a / b if a is not None and b else None
            pairs = [f"{on['cpu_ms_per_token'] / off['cpu_ms_per_token']:.2f}"
                     for off, on in zip(runs["off"], runs["on"], strict=False)
                     if on["cpu_ms_per_token"] and off["cpu_ms_per_token"]]
            out.append({"workload": wl, "concurrency": conc,
                        "arm": f"on/off (CPU per pair {', '.join(pairs)})", **ratio})
    return out


def start(spec: bool, log: Path) -> Cluster:
    try:
        return Cluster(spec, log)
    except RuntimeError as e:  # a worker can miss its start timeout on a loaded machine
        print(f"{e}; trying once more", file=sys.stderr, flush=True)
        return Cluster(spec, log.with_suffix(".retry.log"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2, help="runs of each arm per cell")
    p.add_argument("--c1-prompts", type=int, default=8)
    p.add_argument("--c16-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--workloads", default="hit,no-hit")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--result-dir", type=Path, default=Path("bench_results/spec_serve"))
    args = p.parse_args()
    if args.pairs < 1:
        raise ValueError(f"--pairs must be at least 1, got {args.pairs}")
    args.result_dir = args.result_dir.resolve()
    paths = write_workloads(args.result_dir, max(args.c1_prompts, args.c16_prompts))
    prompts = {1: args.c1_prompts, 16: args.c16_prompts}
    concurrency = [int(c) for c in args.concurrency.split(",")]
    print(f"start {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, "
          f"load {os.getloadavg()}", flush=True)
    clusters = {}
    try:
        for arm in ("off", "on"):
            clusters[arm] = start(arm == "on", args.result_dir / f"up-{arm}.log")
        # A first request pays one-off costs (kernels, caches; the drafter's step-cost
        # tables): each cluster serves every workload once before anything counts.
        for arm, cluster in clusters.items():
            for wl in args.workloads.split(","):
                bench(cluster, wl, paths[wl], 16, 16, args, f"warmup-{wl}-{arm}")
        rows = []
        for wl in args.workloads.split(","):
            for conc in concurrency:
                for i in range(args.pairs):
                    for arm in ("off", "on") if i % 2 == 0 else ("on", "off"):
                        idle = clusters["on" if arm == "off" else "off"]
                        idle_cpu = idle.decode_cpu_s()
                        r = bench(clusters[arm], wl, paths[wl], conc,
                                  prompts.get(conc, args.c16_prompts), args,
                                  f"{wl}-c{conc}-{i}-{arm}")
                        r["idle_cpu_s"] = (None if idle_cpu is None
                                           else idle.decode_cpu_s() - idle_cpu)
                        rows.append({"workload": wl, "concurrency": conc, "arm": arm, **r})
                        print(table(rows[-1:]).splitlines()[-1]
                              + f" idle arm's decode CPU {fmt(r['idle_cpu_s'], '.2f')} s",
                              flush=True)
    finally:
        for cluster in clusters.values():
            cluster.stop()
    print(f"end {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, "
          f"load {os.getloadavg()}\n")
    print(table(summarize(rows)))
    (args.result_dir / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
