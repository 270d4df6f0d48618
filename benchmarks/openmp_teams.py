"""What a second OpenMP team costs a decode step (engine/openmp.py).

    PYTHONPATH=. .venv/bin/python benchmarks/openmp_teams.py [--requests 64] [--dtype bfloat16]

Each arm runs in a fresh process (a team, once started, lives as long as
its thread): the bundled SmolLM2 is built either on the thread that then
steps it (``same``, as a worker does since the engine thread builds its
own engine), or on the main thread and stepped on another (``split``: two
teams, as before). N requests of 128 random tokens -> 64 tokens, greedy;
the decode steps' p50 and the process's context switches are printed.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FIRST_PLAIN_TOKEN = 100  # SmolLM2's special tokens sit below this
ARMS = ("same", "split")


def switches() -> tuple[int, int]:
    """Voluntary and involuntary context switches of all this process's threads."""
    vol = invol = 0
    for task in Path("/proc/self/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                vol += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                invol += int(line.split()[1])
    return vol, invol


def run_arm(arm: str, requests: int, dtype: str) -> dict:
    from tandem import LLM, SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    result: dict = {}

    def build():
        return LLM(dtype=dtype, seed=0, enable_prefix_caching=False).engine

    def burst(engine, n: int, tag: str) -> list[float]:
        for i in range(n):
            prompt = [rng.randrange(FIRST_PLAIN_TOKEN, 49000) for _ in range(128)]
            engine.add_request(f"{tag}{i}", prompt, params)
        steps = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        return steps

    def stepper(engine=None):
        engine = engine or build()
        burst(engine, 4, "warm")
        before = switches()
        steps = burst(engine, requests, "r")
        after = switches()
        decode = sorted(steps[len(steps) // 4:])  # past the prefill steps
        result.update(arm=arm, steps=len(steps), wall_s=sum(steps),
                      decode_p50_ms=1000 * decode[len(decode) // 2],
                      voluntary=after[0] - before[0], involuntary=after[1] - before[1])

    engine = build() if arm == "split" else None
    thread = threading.Thread(target=stepper, args=(engine,), name="engine")
    thread.start()
    thread.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.requests, args.dtype)))
        return
    print(f"{args.requests} requests x 128 -> 64 tokens, {args.dtype}")
    print("| arm | decode step p50 | burst wall | output tok/s | ctx switches vol / invol |")
    print("|---|---:|---:|---:|---:|")
    for _ in range(args.repeat):
        for arm in ARMS:
            out = subprocess.run([sys.executable, __file__, "--arm", arm, "--requests",
                                  str(args.requests), "--dtype", args.dtype],
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"| {arm} | {r['decode_p50_ms']:.1f} ms | {r['wall_s']:.2f} s | "
                  f"{args.requests * 64 / r['wall_s']:.0f} | "
                  f"{r['voluntary']} / {r['involuntary']} |", flush=True)


if __name__ == "__main__":
    main()
