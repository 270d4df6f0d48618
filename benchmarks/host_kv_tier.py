"""The host KV tier on SmolLM2: a long prefix evicted from a small KV cache,
asked for again, recomputed (no tier) or copied back from host memory.

    PYTHONPATH=. python benchmarks/host_kv_tier.py [--prefix 1024] [--repeats 3]

The device cache holds only a little more than one request, so a second,
unrelated request evicts the first one's cached prefix. The first request
is then sent again and its time to first token measured (one output token);
with ``host_kv_cache_gib`` the prefix's blocks come back from the host pool
(on the CPU a second pool in RAM) instead of being recomputed.
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rng = random.Random(0)
    one = SamplingParams(temperature=0, max_tokens=1)
    blocks = (args.prefix + 16) // 16 + 2  # one request and a little
    print(f"{'host tier':>10} {'TTFT s (median)':>16} {'cached tokens':>14} {'restored blocks':>16}")
    for gib in (0.0, 1.0):
        llm = LLM(dtype="float32", num_blocks=blocks, host_kv_cache_gib=gib)
        times, cached = [], 0
        for _ in range(args.repeats):
            first = [rng.randrange(1000, 40000) for _ in range(args.prefix)]
            other = [rng.randrange(1000, 40000) for _ in range(args.prefix)]
            llm.generate([first], one, use_tqdm=False)
            llm.generate([other], one, use_tqdm=False)  # evicts first's blocks
            start = time.perf_counter()
            out = llm.generate([first], one, use_tqdm=False)[0]
            times.append(time.perf_counter() - start)
            cached = out.num_cached_tokens
        stats = llm.engine.stats()
        print(f"{gib:>8.1f}G {statistics.median(times):>16.3f} {cached:>14} "
              f"{stats.host_tier_restored_blocks:>16}")


if __name__ == "__main__":
    main()
