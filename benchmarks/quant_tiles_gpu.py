"""Launch sweep of the 4-bit GPTQ/AWQ matmul on a GPU.

    python benchmarks/quant_tiles_gpu.py [--out quant_tiles.json]

kernels_gpu.py's shape (Llama-3-8B gate/up, 4096 -> 28672, groups of 128,
bfloat16 activations) at 1, 16 and 256 tokens: the launch with scales loaded
per input row (as act-order checkpoints need), and every (block_n, block_k,
num_warps) below with scales loaded once per slice (rows in order), each
checked against the float32 reference before it is timed, beside a dense
bfloat16 matmul.
Prints the best launch per token count. Needs CUDA; downloads nothing.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import checked_ms, sweep_args, time_ms  # noqa: E402

K, N, GROUP = 4096, 2 * 14336, 128
TOKENS = (1, 16, 256)
# (block_n, block_k, num_warps, scales once per slice): the launch act-order
# layers get (scales per input row), then scales per slice at every tile.
LAUNCHES = [(64, 64, 4, False),
            *((n, k, w, True) for n, k, w in itertools.product((64, 128), (64, 128), (4, 8)))]


def main() -> None:
    from kernels import reference
    from kernels.quant_matmul import quant_matmul

    args = sweep_args(__doc__, "quant_tiles.json")
    dev = "cuda"
    qweight = torch.randint(-(1 << 31), (1 << 31) - 1, (K // 8, N), dtype=torch.int32, device=dev)
    scales = torch.rand(K // GROUP, N, dtype=torch.bfloat16, device=dev) * 0.01
    zeros = torch.randint(0, 16, (K // GROUP, N), device=dev).to(torch.bfloat16)
    g_idx = torch.arange(K, dtype=torch.int32, device=dev) // GROUP
    dense = torch.randn(K, N, dtype=torch.bfloat16, device=dev)
    weight_bytes = qweight.numel() * 4 + 2 * scales.numel() * 2
    rows = []
    for m in TOKENS:
        x = torch.randn(m, K, dtype=torch.bfloat16, device=dev)
        ref = reference.quant_matmul(x.float(), qweight, scales.float(), zeros.float(), g_idx, 4)
        row = {"tokens": m, "dense_ms": time_ms(lambda x=x: torch.matmul(x, dense)),
               "launches": []}
        for block_n, block_k, warps, uniform in LAUNCHES:
            def fn(x=x, bn=block_n, bk=block_k, w=warps, u=uniform):
                return quant_matmul(x, qweight, scales, zeros, g_idx, 4, block_n=bn,
                                    block_k=bk, num_warps=w, uniform_rows=GROUP if u else 0)
            entry = {"block_n": block_n, "block_k": block_k, "num_warps": warps,
                     "uniform_groups": uniform, **checked_ms(fn, ref)}
            if "ms" in entry:
                entry["weight_gbps"] = weight_bytes / entry["ms"] / 1e6
            row["launches"].append(entry)
        rows.append(row)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"{m} tokens swept", flush=True)
    print(f"\n{'tokens':>6} {'dense us':>9} {'per-row us':>11} {'best us':>8}  best launch"
          " (block_n, block_k, warps, uniform)  GB/s of weights")
    for r in rows:
        ok = [e for e in r["launches"] if "ms" in e]
        per_row = r["launches"][0].get("ms")  # LAUNCHES[0]: scales per input row
        per_row_us = f"{1e3 * per_row:>11.1f}" if per_row else f"{'-':>11}"
        line = f"{r['tokens']:>6} {1e3 * r['dense_ms']:>9.1f} {per_row_us}"
        if ok:
            best = min(ok, key=lambda e: e["ms"])
            line += (f" {1e3 * best['ms']:>8.1f}  ({best['block_n']}, {best['block_k']},"
                     f" {best['num_warps']}, {best['uniform_groups']})  {best['weight_gbps']:.0f}")
        print(line)
        errors = [e["error"] for e in r["launches"] if "error" in e]
        if errors:
            print(f"{'':>6} {len(errors)} launches failed, e.g. {errors[0]}")

if __name__ == "__main__":
    main()
