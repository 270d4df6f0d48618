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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels_gpu import (  # noqa: E402
    HEAD_DIM,
    NUM_HEADS,
    PREFILL_CASES,
    dense_kv,
    paged_cache,
    sweep_args,
    time_ms,
)

LAUNCHES = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)))


def sweep_case(num_seqs: int, cached: int, new: int) -> dict:
    from kernels.prefill_attention import paged_prefill_attention

    seq_len = cached + new
    k_cache, v_cache, table = paged_cache([seq_len] * num_seqs, "cuda")
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, (num_seqs + 1) * new, new, dtype=torch.int32, device="cuda")
    query = torch.randn(num_seqs * new, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    keys_seen = new * cached + new * (new + 1) // 2
    flops = 4 * HEAD_DIM * NUM_HEADS * num_seqs * keys_seen

    from torch.nn.attention.bias import causal_lower_right
    k_dense, v_dense = dense_kv(k_cache, table, seq_len), dense_kv(v_cache, table, seq_len)
    q_dense = query.view(num_seqs, new, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    mask = None if cached == 0 else causal_lower_right(new, seq_len)

    def sdpa():
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, attn_mask=mask,
                                              is_causal=cached == 0, scale=scale,
                                              enable_gqa=True)

    ref = sdpa().transpose(1, 2).reshape_as(out).float()
    row = {"case": [num_seqs, cached, new], "flops": flops, "sdpa_ms": time_ms(sdpa),
           "default_ms": None, "launches": []}
    default = lambda: paged_prefill_attention(query, k_cache, v_cache, table, starts,  # noqa: E731
                                              seq_lens, scale, new, out=out)
    row["default_ms"] = time_ms(default)
    for block_m, block_n, warps, stages in LAUNCHES:
        def fn(bm=block_m, bn=block_n, w=warps, s=stages):
            paged_prefill_attention(query, k_cache, v_cache, table, starts, seq_lens, scale, new,
                                    out=out, block_m=bm, block_n=bn, num_warps=w, num_stages=s)
        entry = {"block_m": block_m, "block_n": block_n, "num_warps": warps,
                 "num_stages": stages}
        try:
            out.fill_(float("nan"))
            fn()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            entry["rel_err"] = err
            if not err < 2e-2:
                entry["error"] = f"relative error {err:.3g}"
            else:
                entry["ms"] = time_ms(fn)
                entry["tflops"] = flops / entry["ms"] / 1e9
        except Exception as e:  # e.g. out of shared memory for this tile
            entry["error"] = str(e).splitlines()[0][:160]
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
