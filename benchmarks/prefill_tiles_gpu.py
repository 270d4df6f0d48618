"""Tile and launch sweep of the paged prefill attention kernel on a GPU.

    python benchmarks/prefill_tiles_gpu.py [--out prefill_tiles.json]

kernels_gpu.py's prefill cases (Llama-3-8B attention shapes, bfloat16,
16-token blocks, shuffled tables), each timed for every (block_m, block_n,
num_warps, num_stages) below, beside dense SDPA on the same data. Prints the
best launch per case and the launch that is best over all cases (geometric
mean of the speedup over the current default). Each launch's output is
checked against SDPA's before it is timed. Needs CUDA; downloads nothing.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import checked_ms, sweep_args, time_ms  # noqa: E402
from kernels_gpu import PREFILL_CASES, prefill_case  # noqa: E402

LAUNCHES = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)))


def sweep_case(num_seqs: int, cached: int, new: int, device: str = "cuda") -> dict:
    case = prefill_case(num_seqs, cached, new, device)
    ref = case.sdpa_like_out()
    row = {"case": [num_seqs, cached, new], "flops": case.flops, "sdpa_ms": time_ms(case.sdpa),
           "default_ms": time_ms(case.triton), "launches": []}
    for block_m, block_n, warps, stages in LAUNCHES:
        def fn(bm=block_m, bn=block_n, w=warps, s=stages):
            return case.triton(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
        case.out.fill_(float("nan"))  # a row the launch leaves unwritten fails the check
        entry = {"block_m": block_m, "block_n": block_n, "num_warps": warps,
                 "num_stages": stages, **checked_ms(fn, ref)}
        if "ms" in entry:
            entry["tflops"] = case.flops / entry["ms"] / 1e9
        row["launches"].append(entry)
    torch.cuda.empty_cache()
    return row


def main() -> None:
    args = sweep_args(__doc__, "prefill_tiles.json")
    rows = []
    for case in PREFILL_CASES:
        rows.append(sweep_case(*case))
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"prefill {case} swept", flush=True)
    print(f"\n{'case':>16} {'sdpa ms':>8} {'default':>8} {'best':>8}  best launch (m, n, warps, stages)")
    for r in rows:
        ok = [e for e in r["launches"] if "ms" in e]
        if not ok:
            print(f"{str(tuple(r['case'])):>16}  no launch passed its check")
            continue
        best = min(ok, key=lambda e: e["ms"])
        print(f"{str(tuple(r['case'])):>16} {r['sdpa_ms']:>8.3f} {r['default_ms']:>8.3f}"
              f" {best['ms']:>8.3f}  ({best['block_m']}, {best['block_n']},"
              f" {best['num_warps']}, {best['num_stages']})  {best['tflops']:.0f} TFLOP/s")
    scores = []
    for i, launch in enumerate(LAUNCHES):
        times = [r["launches"][i].get("ms") for r in rows]
        if all(t is not None for t in times):
            gain = math.exp(sum(math.log(r["default_ms"] / t) for r, t in zip(rows, times))
                            / len(rows))
            scores.append((gain, launch, times))
    scores.sort(reverse=True)
    print("\nbest launches over all cases (geometric-mean speedup over the default):")
    for gain, launch, times in scores[:5]:
        print(f"  {launch}: x{gain:.2f}  ms " + " ".join(f"{t:.3f}" for t in times))


if __name__ == "__main__":
    main()
