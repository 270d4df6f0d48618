"""What a busy neighbour process costs a decode step on a small host.

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_neighbour.py [--duty 0,0.1,0.2] [--requests 64]

Served, the engine shares the host's cores with the processes that carry
its tokens: the gateway, the worker's event loop, the clients. This puts a
number on that: an offline burst of the bundled SmolLM2 (N requests of 128
random tokens -> 64, greedy, bf16) steps beside a process that spins for
``duty`` of every millisecond and sleeps the rest, and the decode steps'
p50 is printed for each duty. Every parallel region of a step waits at its
barrier for the thread the neighbour displaced, so a neighbour taking a
fifth of one core costs a 2-core step about a fifth, not a tenth.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FIRST_PLAIN_TOKEN = 100  # SmolLM2's special tokens sit below this
PERIOD_S = 0.001


def neighbour(duty: float) -> None:
    """Spin for ``duty`` of every period, sleep for the rest."""
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < duty * PERIOD_S:
            pass
        time.sleep(PERIOD_S * (1 - duty))


def decode_steps(engine, requests: int, rng: random.Random) -> tuple[list[float], float]:
    from tandem import SamplingParams

    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    for i in range(requests):
        prompt = [rng.randrange(FIRST_PLAIN_TOKEN, 49000) for _ in range(128)]
        engine.add_request(f"r{rng.random()}-{i}", prompt, params)
    steps, start = [], time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return sorted(steps[len(steps) // 4:]), time.perf_counter() - start  # past the prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duty", default="0,0.1,0.2",
                        help="the neighbour's busy fraction of one core, comma-separated")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--spin", type=float, help=argparse.SUPPRESS)  # the neighbour itself
    args = parser.parse_args()
    if args.spin is not None:
        neighbour(args.spin)
    from engine.warmup import warm_up
    from tandem import LLM

    engine = LLM(dtype=args.dtype, seed=0, enable_prefix_caching=False).engine
    warm_up(engine)
    rng = random.Random(0)
    print(f"{args.requests} requests x 128 -> 64 tokens, {args.dtype}")
    print("| neighbour busy | decode step p50 | burst wall | output tok/s |")
    print("|---:|---:|---:|---:|")
    for _ in range(args.repeat):
        for duty in (float(d) for d in args.duty.split(",")):
            # NOTE: a process of its own, not a fork: a forked child would
            # share this one's pages copy-on-write, and every write of a step
            # would fault (26,000 faults a prefill step, measured).
            proc = None if duty == 0 else subprocess.Popen(
                [sys.executable, __file__, "--spin", str(duty)])
            try:
                decode, wall = decode_steps(engine, args.requests, rng)
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
            print(f"| {duty:.0%} of a core | {1000 * decode[len(decode) // 2]:.1f} ms | "
                  f"{wall:.2f} s | {args.requests * 64 / wall:.0f} |", flush=True)


if __name__ == "__main__":
    main()
