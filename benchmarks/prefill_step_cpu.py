"""bfloat16 prefill of the bundled SmolLM2-135M on the CPU, with long-prompt
attention by the AMX kernel and by SDPA over gathered blocks, interleaved.

    PYTHONPATH=. python benchmarks/prefill_step_cpu.py [--workloads 16x128,1x2048,1x8000]
        [--reps 3] [--threshold none]

One engine (``LLM(dtype="bfloat16")``, ``long_prefill_token_threshold`` as
``--threshold``, ``none`` by default so that 16 x 128 and 1 x 2048 each fit
one step of the 2048-token budget and 8000 tokens take four chunks, the
later ones after cached tokens). For each repetition and workload, each arm
in turn: fresh random prompts (no prefix-cache hits), one output token
each, the engine stepped until all are done; wall ms from the first step
to the last. ``sdpa`` is the torch backend with ``amx_prefill.supports``
patched to False (the path before the AMX kernel); ``amx`` the default.
Medians over ``--reps``; ``uptime`` before and after.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.attention import torch_backend  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402

FIRST_PLAIN_TOKEN = 100  # SmolLM2's special tokens sit below this


class NoAmx:
    """The torch backend's view of amx_prefill with the kernel switched off."""

    def __init__(self, module):
        self.prefill = module.prefill

    @staticmethod
    def supports(query, k_cache) -> bool:
        return False


def run(llm: LLM, num: int, length: int, rng: random.Random) -> float:
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i in range(num):
        prompt = [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(length)]
        engine.add_request(f"r{rng.random()}-{i}", prompt, one)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - start) * 1e3


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="16x128,1x2048,1x8000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threshold", default="none")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    threshold = None if args.threshold == "none" else int(args.threshold)
    longest = max(length for _, length in shapes)
    llm = LLM(dtype="bfloat16", long_prefill_token_threshold=threshold,
              max_model_len=longest + 64)
    rng = random.Random(0)
    real = torch_backend.amx_prefill
    arms = {"sdpa": NoAmx(real), "amx": real}
    print("uptime:", uptime())
    print(f"dtype {llm.engine.config.dtype}, threshold {threshold}, AMX kernel "
          f"{real.available()}")
    run(llm, 2, 64, rng)  # warm: first-step costs, kernel builds
    times = {(shape, arm): [] for shape in shapes for arm in arms}
    for _ in range(args.reps):
        for shape in shapes:
            for arm, module in arms.items():
                torch_backend.amx_prefill = module
                try:
                    times[shape, arm].append(run(llm, *shape, rng))
                finally:
                    torch_backend.amx_prefill = real
    for shape in shapes:
        cells = [f"{arm} {statistics.median(times[shape, arm]):.0f} ms "
                 f"({', '.join(f'{t:.0f}' for t in times[shape, arm])})" for arm in arms]
        print(f"{shape[0]} x {shape[1]}: " + "; ".join(cells))
    print("uptime:", uptime())


if __name__ == "__main__":
    main()
