"""What the CPU path of 8-bit weights costs per call: one SmolLM2-sized
linear layer (576 -> 1536, gate/up's shape) as float32 ``F.linear`` and as
``ScaledLinear`` (dequantize the weight every call; W8A8 also quantizes the
input), for a decode-sized and a prefill-sized input.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/scaled_linear_cpu.py [--dtype bfloat16]

(``--dtype``: the inputs' and the float layer's dtype; INT8 layers take
torch's int8 GEMV for bfloat16 inputs of up to 32 rows.)

CPU time per call (process time, steadier than wall time on a shared
machine), median of ``--reps``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.layers.scaled_linear import ScaledLinear  # noqa: E402
from engine.quantization.compressed_config import SCHEMES, CompressedConfig  # noqa: E402


def cpu_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weight = torch.randn(1536, 576) * 0.02
    print(f"{'layer':<12} {'1 token':>9} {'256 tokens':>11}  (ms of CPU per call)")
    inputs = {n: torch.randn(n, 576, dtype=dtype) for n in (1, 256)}
    dense = weight.to(dtype)
    row = {n: cpu_ms(lambda x=x: F.linear(x, dense), args.reps) for n, x in inputs.items()}
    print(f"{args.dtype:<12} {row[1]:>9.3f} {row[256]:>11.3f}")
    for method, scheme in SCHEMES.items():
        cfg = CompressedConfig(*scheme, online=True)
        layer = ScaledLinear(576, 1536, False, cfg)
        layer.weight.data.copy_(weight)
        layer.finish_loading()
        with torch.inference_mode():
            row = {n: cpu_ms(lambda x=x, f=layer: f(x), args.reps) for n, x in inputs.items()}
        print(f"{method:<12} {row[1]:>9.3f} {row[256]:>11.3f}")


if __name__ == "__main__":
    main()
