"""kernels_gpu.py's results as text tables (what it prints after writing its JSON)."""

from __future__ import annotations


def _fmt(value, scale=1.0, digits=1, pct=False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.0f}%" if pct else f"{value / scale:.{digits}f}"


def print_tables(result: dict, target: tuple[int, int, float]) -> None:
    """The results as text tables; `target`: (decode batch, context, wanted fraction of peak)."""
    print(f"\n{result['device']}  peak {_fmt(result['peak_bw'], 1e12, 2)} TB/s, "
          f"{_fmt(result['peak_tflops'], 1e12, 0)} TFLOP/s")
    print("\ndecode: GB/s of K+V+q read (fraction of peak)")
    print(f"{'batch':>6} {'ctx':>6} {'splits':>6} {'triton us':>10} {'GB/s':>7} {'peak':>5}"
          f" {'sdpa us':>9} {'GB/s':>7} {'peak':>5} {'max|diff|':>9}")
    for r in result["decode"]:
        print(f"{r['batch']:>6} {r['context']:>6} {r['num_splits']:>6}"
              f" {_fmt(r['triton_ms'], 1e-3):>10} {_fmt(r['triton_bw'], 1e9, 0):>7}"
              f" {_fmt(r['triton_frac_peak'], pct=True):>5}"
              f" {_fmt(r.get('sdpa_ms'), 1e-3):>9} {_fmt(r.get('sdpa_bw'), 1e9, 0):>7}"
              f" {_fmt(r.get('sdpa_frac_peak'), pct=True):>5}"
              f" {_fmt(r.get('max_abs_diff_vs_sdpa'), digits=4):>9}")
    print("\ndecode tiles at the target shape (batch 64, context 2048)")
    for r in result["decode_tiles"]:
        print(f"  block_n {r['block_n']:>4} splits {r['num_splits']:>2}:"
              f" {_fmt(r['triton_bw'], 1e9, 0)} GB/s ({_fmt(r['triton_frac_peak'], pct=True)})")
    print("\nprefill: TFLOP/s of causal attention (fraction of peak)")
    print(f"{'seqs':>5} {'cached':>7} {'new':>6} {'triton ms':>10} {'TFLOP/s':>8} {'peak':>5}"
          f" {'sdpa ms':>8} {'TFLOP/s':>8} {'peak':>5} {'max|diff|':>9}")
    for r in result["prefill"]:
        print(f"{r['num_seqs']:>5} {r['cached']:>7} {r['new']:>6}"
              f" {_fmt(r['triton_ms'], digits=3):>10} {_fmt(r['triton_flops'], 1e12):>8}"
              f" {_fmt(r['triton_frac_peak'], pct=True):>5}"
              f" {_fmt(r.get('sdpa_ms'), digits=3):>8} {_fmt(r.get('sdpa_flops'), 1e12):>8}"
              f" {_fmt(r.get('sdpa_frac_peak'), pct=True):>5}"
              f" {_fmt(r.get('max_abs_diff_vs_sdpa'), digits=4):>9}")
    print("\nfused layers vs the torch reference (us)")
    for r in result.get("layers", []):
        print(f"  {r['op']:<13} tokens {r['tokens']:>5}: fused {_fmt(r['fused_ms'], 1e-3)}"
              f"  torch {_fmt(r['torch_ms'], 1e-3)}  x{r['speedup']:.2f}")
    print("\n4-bit matmul 4096 -> 28672 vs dense bfloat16 (us)")
    for r in result.get("quant_matmul", []):
        print(f"  tokens {r['tokens']:>4}: int4 {_fmt(r['quant_ms'], 1e-3)}"
              f" ({r['quant_weight_gbps']:.0f} GB/s of weights)"
              f"  bf16 {_fmt(r['dense_ms'], 1e-3)}  x{r['speedup_vs_dense']:.2f}")
    print("\n8-bit weights (W8A16) 4096 -> 28672 vs dense bfloat16 (us)")
    for r in result.get("scaled_matmul", []):
        print(f"  tokens {r['tokens']:>4}: {r['weights']:<4} {_fmt(r['ms'], 1e-3)}"
              f" ({r['weight_gbps']:.0f} GB/s of weights)"
              f"  bf16 {_fmt(r['dense_ms'], 1e-3)}  x{r['speedup_vs_dense']:.2f}")
    batch, ctx, wanted = target
    hit = next(r for r in result["decode"] if r["batch"] == batch and r["context"] == ctx)
    if hit["triton_frac_peak"] is not None:
        verdict = "meets" if hit["triton_frac_peak"] >= wanted else "MISSES"
        print(f"\ndecode batch {batch} x {ctx}: {_fmt(hit['triton_frac_peak'], pct=True)}"
              f" of peak bandwidth, {verdict} the {wanted:.0%} target")
