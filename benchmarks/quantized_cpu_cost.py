"""What quantized weights cost on the CPU against bfloat16: SmolLM2-135M as
``tandem quantize`` writes it (compressed-tensors 8-bit weights with scales,
and pack-quantized integers), every model in bfloat16 activations.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quantized_cpu_cost.py [--reps 3]

Speed is tokens per second of CPU time (process time, one thread): on a
shared machine wall time measures the neighbours, CPU time mostly the work.
All models are loaded at once and the arms interleaved (each rep runs every
model once, in order), so what load remains hits them alike; the figures are
medians over reps. Per model: bytes of the decoder's linear weights (with
their scales and zero points), decode tokens per CPU-second at batch 1 and 8
(``--tokens`` output tokens after an 8-token prompt), and prefill tokens per
CPU-second of one 512-token prompt.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.quantization.writer import quantize_model  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402

# name: (tandem quantize --method, --bits, --group-size), None: the float model
VARIANTS = {
    "bf16": None,
    "int8-w8a16": ("int8-w8a16", 8, -1),
    "fp8-w8a16": ("fp8-w8a16", 8, -1),
    "int8 (w8a8)": ("int8", 8, -1),
    "fp8 (w8a8)": ("fp8", 8, -1),
    "wna16 8-bit": ("wna16", 8, -1),
    "wna16 4-bit g64": ("wna16", 4, 64),
}


def linear_bytes(llm: LLM) -> int:
    model = llm.engine.runner.model
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if "layers." in n and "proj" in n)


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """CPU seconds of generating ``max_tokens`` for each prompt."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    return time.process_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="output tokens per decode request")
    args = p.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    short = [[rng.randrange(100, 40000) for _ in range(8)] for _ in range(8)]
    long = [[rng.randrange(100, 40000) for _ in range(512)]]
    runs: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        llms = {}
        for name, how in VARIANTS.items():
            path = None if how is None else str(quantize_model(None, Path(tmp) / name, *how))
            # A small fixed cache: seven engines share the host's memory.
            llms[name] = LLM(path, dtype="bfloat16", num_blocks=128, enable_prefix_caching=False)
            timed(llms[name], short[:1], 4)  # warm-up
            print(f"{name}: written and loaded", flush=True)
        for rep in range(args.reps):
            for name, llm in llms.items():
                r = runs.setdefault(name, {"b1": [], "b8": [], "prefill": []})
                r["b1"].append(args.tokens / timed(llm, short[:1], args.tokens))
                r["b8"].append(8 * args.tokens / timed(llm, short, args.tokens))
                r["prefill"].append(len(long[0]) / timed(llm, long, 1))
            print(f"rep {rep + 1}/{args.reps} done", flush=True)
        print(f"\n{'model':<16} {'linear MB':>9} {'decode b1':>10} {'decode b8':>10}"
              f" {'prefill':>8}   (tokens per CPU-second, median of {args.reps})")
        for name, llm in llms.items():
            r = {k: statistics.median(v) for k, v in runs[name].items()}
            print(f"{name:<16} {linear_bytes(llm) / 1e6:>9.1f} {r['b1']:>10.1f}"
                  f" {r['b8']:>10.1f} {r['prefill']:>8.0f}")


if __name__ == "__main__":
    main()
