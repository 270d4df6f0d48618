"""Where one decode step of the bundled SmolLM2 goes, end to end through
``LLMEngine.step()``.

    PYTHONPATH=. .venv/bin/python benchmarks/step_breakdown.py [--requests 64] [--dtype auto]

N requests of 128 random tokens are prefilled, then decode steps are timed:
as they are, with the attention backend replaced by the identity (the
difference is attention's share: the kernel, and storing the new keys and
values), and under torch's profiler, which names the matrix multiplies and
the argmax (the C kernels run outside torch and show up in no row).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem import LLM, SamplingParams  # noqa: E402

FIRST_PLAIN_TOKEN = 100  # SmolLM2's special tokens sit below this


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    engine = LLM(dtype=args.dtype).engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=8 * args.steps + 16, temperature=0, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"r{i}", [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(128)],
                           params)
    started: set[str] = set()
    while len(started) < args.requests:  # the prefills
        started.update(out.request_id for out in engine.step())

    def ms_per_step() -> float:
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        return (time.perf_counter() - t) / args.steps * 1e3

    backend = engine.runner.backend  # a benchmark may look inside
    whole = ms_per_step()
    real = backend.forward
    backend.forward = lambda q, k, v, k_cache, v_cache, meta, scale: q
    without_attention = ms_per_step()
    backend.forward = real
    with profile() as prof:
        profiled = ms_per_step()
    rows = {e.key: e.self_cpu_time_total / 1e3 / args.steps for e in prof.key_averages()}
    linear = sum(v for k, v in rows.items() if "linear" in k or k in ("aten::mm", "aten::addmm"))

    print(f"{args.requests} running requests, dtype {engine.config.dtype}, "
          f"context {129} to {129 + 3 * args.steps} tokens over the three timings")
    print(f"{'step':<40}{whole:>8.1f} ms")
    print(f"{'  attention (step - step without it)':<40}{whole - without_attention:>8.1f} ms")
    print(f"{'  linear layers and LM head (profiler)':<40}{linear:>8.1f} ms")
    print(f"{'  argmax (profiler)':<40}{rows.get('aten::argmax', 0.0):>8.1f} ms")
    print(f"{'  (step under the profiler)':<40}{profiled:>8.1f} ms")


if __name__ == "__main__":
    main()
