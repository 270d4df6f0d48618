"""Tensor parallelism's cost per step: SmolLM2-135M split over 1 and 3 ranks.

    PYTHONPATH=. python benchmarks/tensor_parallel.py [--sizes 1 3] [--num-requests 8]

SmolLM2 has 9 query heads and 3 kv heads, so it splits over 1 or 3 ranks.
One seeded workload (random-token prompts of 64..256 tokens, 64 greedy
output tokens each, all submitted at once) runs at each size. Reports output
tokens per second and the mean engine step time. On a machine with fewer
cores than ranks this measures overhead (the broadcast of each step and two
all-reduces per layer), not speed-up; on GPUs it is the other way round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem import LLM, SamplingParams  # noqa: E402


def run(size: int, prompts: list[list[int]], output_len: int) -> dict:
    llm = LLM(dtype="float32", tensor_parallel_size=size)
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        steps, tokens = [], 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            steps.append(time.perf_counter() - t0)
            tokens += sum(len(o.outputs[0].delta_token_ids) for o in outs)
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    return {"size": size, "tokens": tokens, "seconds": elapsed, "tok_per_s": tokens / elapsed,
            "mean_step_ms": 1000 * statistics.mean(steps),
            "median_step_ms": 1000 * statistics.median(steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(64, 256))]
               for _ in range(args.num_requests)]
    rows = [run(size, prompts, args.output_len) for size in args.sizes]
    print(f"\n{'ranks':>5} {'tok/s':>7} {'mean step ms':>13} {'median step ms':>15}")
    for r in rows:
        print(f"{r['size']:>5} {r['tok_per_s']:>7.1f} {r['mean_step_ms']:>13.1f}"
              f" {r['median_step_ms']:>15.1f}")


if __name__ == "__main__":
    main()
