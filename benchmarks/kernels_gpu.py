"""GPU benchmark of the paged attention kernels against dense SDPA.

    python benchmarks/kernels_gpu.py [--out kernels_gpu.json] [--peak-bw B/s] [--peak-tflops F/s]

Llama-3-8B attention shapes (32 query heads, 8 kv heads, head dim 128,
bfloat16, 16-token cache blocks, shuffled block tables). Decode is reported
as achieved memory bandwidth, bytes of K, V and q read over kernel time;
prefill as TFLOP/s of the causal attention it computes. Both are set beside
torch.nn.functional.scaled_dot_product_attention on the same data laid out
densely, and as a fraction of the device's peak. Needs CUDA; downloads
nothing; a few minutes on an H100/H200.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_timing import device_peaks, time_ms

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_BATCHES = [1, 16, 64, 256]
DECODE_CONTEXTS = [512, 2048, 8192]
# (sequences, cached tokens each, new tokens each)
PREFILL_CASES = [(1, 0, 8192), (4, 0, 2048), (16, 0, 512), (4, 2048, 512)]
TARGET = (64, 2048, 0.70)  # decode batch, context, wanted fraction of peak bandwidth


def paged_cache(seq_lens: list[int], device: str):
    """Random K/V caches and shuffled block tables holding ``seq_lens`` tokens."""
    blocks = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    total = sum(blocks)
    shape = (total, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device=device)
    v_cache = torch.randn(shape, dtype=DTYPE, device=device)
    order = torch.randperm(total, device=device).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    taken = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = order[taken : taken + nb]
        taken += nb
    return k_cache, v_cache, table


def dense_kv(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of each row of ``table``: [seqs, kv_heads, length, dim]."""
    gathered = cache[table.long()].flatten(1, 2)[:, :length]  # [seqs, tokens, kv, dim]
    return gathered.transpose(1, 2).contiguous()


def bench_decode(
    batch: int, ctx: int, peak_bw: float | None, device: str, with_sdpa: bool = True, **launch
) -> dict:
    from kernels.decode_attention import choose_num_splits, paged_decode_attention

    k_cache, v_cache, table = paged_cache([ctx] * batch, device)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5

    def triton_fn():
        paged_decode_attention(
            query, k_cache, v_cache, table, seq_lens, scale, max_seq_len=ctx, out=out, **launch
        )

    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    read_bytes = kv_bytes + query.numel() * query.element_size()
    t_triton = time_ms(triton_fn)
    splits = launch.get("num_splits") or choose_num_splits(
        batch, NUM_KV_HEADS, ctx, torch.device(device)
    )
    row = {
        "batch": batch,
        "context": ctx,
        "num_splits": splits,
        "block_n": launch.get("block_n"),
        "bytes_read": read_bytes,
        "triton_ms": t_triton,
        "triton_bw": read_bytes / (t_triton * 1e-3),
    }
    row["triton_frac_peak"] = row["triton_bw"] / peak_bw if peak_bw else None
    if not with_sdpa:
        return row

    q_dense = query.unsqueeze(2)  # [batch, heads, 1, dim]
    k_dense = dense_kv(k_cache, table, ctx)
    v_dense = dense_kv(v_cache, table, ctx)

    def sdpa_fn():
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, scale=scale, enable_gqa=True)

    row.update(_bench_sdpa(sdpa_fn, read_bytes, peak_bw, "bw"))
    if row.get("sdpa_ms") is not None:
        triton_fn()
        ref = sdpa_fn().squeeze(2)
        row["max_abs_diff_vs_sdpa"] = (out.float() - ref.float()).abs().max().item()
    return row


def _bench_sdpa(fn, work: float, peak: float | None, unit: str) -> dict:
    try:
        fn()
        t = time_ms(fn)
    except Exception as e:  # e.g. no SDPA kernel for this case in this torch build
        return {"sdpa_ms": None, "sdpa_error": str(e).splitlines()[0][:200]}
    rate = work / (t * 1e-3)
    return {"sdpa_ms": t, f"sdpa_{unit}": rate, "sdpa_frac_peak": rate / peak if peak else None}


@dataclass
class PrefillCase:
    """One prefill case's data: ``num_seqs`` sequences of ``cached`` tokens in
    their paged cache and ``new`` tokens to attend, and the same laid out
    densely for SDPA."""

    num_seqs: int
    cached: int
    new: int
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    out: torch.Tensor
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v for SDPA
    mask: torch.Tensor | None  # None: causal from the top left (nothing cached)

    @property
    def scale(self) -> float:
        return HEAD_DIM**-0.5

    @property
    def flops(self) -> int:
        # New token j sees cached + j + 1 keys; QK^T and PV are 2 * dim FLOPs per key each.
        keys_seen = self.new * self.cached + self.new * (self.new + 1) // 2
        return 4 * HEAD_DIM * NUM_HEADS * self.num_seqs * keys_seen

    def triton(self, **launch) -> torch.Tensor:
        """The paged kernel into ``out`` (``launch``: its tile and launch arguments)."""
        from kernels.prefill_attention import paged_prefill_attention

        return paged_prefill_attention(
            self.query, self.k_cache, self.v_cache, self.table, self.query_start_loc,
            self.seq_lens, self.scale, self.new, out=self.out, **launch,
        )

    def sdpa(self) -> torch.Tensor:
        q, k, v = self.dense
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, is_causal=self.mask is None, scale=self.scale,
            enable_gqa=True,
        )

    def sdpa_like_out(self) -> torch.Tensor:
        """SDPA's output in ``out``'s layout: [tokens, heads, dim]."""
        return self.sdpa().transpose(1, 2).reshape_as(self.out)


def prefill_case(num_seqs: int, cached: int, new: int, device: str) -> PrefillCase:
    seq_len = cached + new
    k_cache, v_cache, table = paged_cache([seq_len] * num_seqs, device)
    query = torch.randn(num_seqs * new, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    mask = None
    if cached:  # new tokens are the last positions: causal aligned to the bottom right
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(new, seq_len)
    return PrefillCase(
        num_seqs, cached, new, query, k_cache, v_cache, table,
        query_start_loc=torch.arange(0, (num_seqs + 1) * new, new, dtype=torch.int32,
                                     device=device),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
        out=torch.empty_like(query),
        dense=(query.view(num_seqs, new, NUM_HEADS, HEAD_DIM).transpose(1, 2),
               dense_kv(k_cache, table, seq_len), dense_kv(v_cache, table, seq_len)),
        mask=mask,
    )


def bench_prefill(
    num_seqs: int, cached: int, new: int, peak_flops: float | None, device: str
) -> dict:
    case = prefill_case(num_seqs, cached, new, device)
    flops = case.flops
    t_triton = time_ms(case.triton)
    row = {
        "num_seqs": num_seqs,
        "cached": cached,
        "new": new,
        "flops": flops,
        "triton_ms": t_triton,
        "triton_flops": flops / (t_triton * 1e-3),
    }
    row["triton_frac_peak"] = row["triton_flops"] / peak_flops if peak_flops else None
    row.update(_bench_sdpa(case.sdpa, flops, peak_flops, "flops"))
    if row.get("sdpa_ms") is not None:
        ref = case.sdpa_like_out()
        out = case.triton()
        row["max_abs_diff_vs_sdpa"] = (out.float() - ref.float()).abs().max().item()
    return row


def bench_layers(device: str) -> list[dict]:
    """The fused RMSNorm (+ residual add) and rotary kernels against the torch
    reference the CPU uses, at Llama-3-8B widths: do they pay for themselves?"""
    from kernels import reference
    from kernels.rms_norm import rms_norm
    from kernels.rotary import apply_rotary

    rows = []
    hidden = NUM_HEADS * HEAD_DIM
    for tokens in (1, 64, 256, 4096):
        x = torch.randn(tokens, hidden, dtype=DTYPE, device=device)
        residual, weight = torch.randn_like(x), torch.randn(hidden, dtype=DTYPE, device=device)
        q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        angles = torch.rand(tokens, HEAD_DIM // 2, device=device)
        cos, sin = angles.cos(), angles.sin()
        for op, fused, ref in (
            ("rms_norm+add", partial(rms_norm, x, weight, 1e-5, residual),
             partial(reference.rms_norm, x, weight, 1e-5, residual)),
            ("rotary(q)", partial(apply_rotary, q, cos, sin),
             partial(reference.apply_rotary, q, cos, sin)),
        ):
            fused_ms, ref_ms = time_ms(fused), time_ms(ref)
            rows.append({"op": op, "tokens": tokens, "fused_ms": fused_ms,
                         "torch_ms": ref_ms, "speedup": ref_ms / fused_ms})
    return rows


def bench_quant_matmul(device: str) -> list[dict]:
    """4-bit GPTQ/AWQ matmul (groups of 128) against a dense bfloat16 matmul,
    at Llama-3-8B's gate/up projection (4096 -> 2 x 14336)."""
    from kernels.quant_matmul import quant_matmul

    k, n, group = 4096, 2 * 14336, 128
    qweight = torch.randint(-(1 << 31), (1 << 31) - 1, (k // 8, n), dtype=torch.int32,
                            device=device)
    scales = torch.rand(k // group, n, dtype=DTYPE, device=device) * 0.01
    zeros = torch.full((k // group, n), 8.0, dtype=DTYPE, device=device)
    g_idx = torch.arange(k, dtype=torch.int32, device=device) // group
    dense = torch.randn(k, n, dtype=DTYPE, device=device)
    rows = []
    for m in (1, 16, 64, 256):
        x = torch.randn(m, k, dtype=DTYPE, device=device)
        quant_ms = time_ms(partial(quant_matmul, x, qweight, scales, zeros, g_idx, 4))
        dense_ms = time_ms(partial(torch.matmul, x, dense))
        weight_bytes = qweight.numel() * 4 + 2 * scales.numel() * 2
        rows.append({"tokens": m, "quant_ms": quant_ms, "dense_ms": dense_ms,
                     "quant_weight_gbps": weight_bytes / quant_ms / 1e6,
                     "speedup_vs_dense": dense_ms / quant_ms})
    return rows


def bench_scaled_matmul(device: str) -> list[dict]:
    """8-bit weights with a scale per output row (compressed-tensors W8A16,
    INT8 and FP8 e4m3) against a dense bfloat16 matmul, same shape as above."""
    from kernels.scaled_matmul import scaled_matmul

    k, n = 4096, 2 * 14336
    weights = {"int8": torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device),
               "fp8": (torch.randn(n, k, device=device) * 64).to(torch.float8_e4m3fn)}
    scale = torch.rand(n, device=device) * 0.01
    dense = torch.randn(n, k, dtype=DTYPE, device=device)
    rows = []
    for m in (1, 16, 64, 256):
        x = torch.randn(m, k, dtype=DTYPE, device=device)
        dense_ms = time_ms(partial(torch.nn.functional.linear, x, dense))
        for name, w in weights.items():
            ms = time_ms(partial(scaled_matmul, x, w, scale))
            rows.append({"weights": name, "tokens": m, "ms": ms, "dense_ms": dense_ms,
                         "weight_gbps": (w.numel() + scale.numel() * 4) / ms / 1e6,
                         "speedup_vs_dense": dense_ms / ms})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="kernels_gpu.json", help="JSON results file")
    parser.add_argument("--peak-bw", type=float, help="device peak memory bandwidth, bytes/s")
    parser.add_argument("--peak-tflops", type=float, help="device peak bf16 dense FLOP/s")
    parser.add_argument("--skip-engine", action="store_true",
                        help="skip the end-to-end engine decode run")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        raise SystemExit("kernels_gpu.py needs a CUDA GPU, and torch sees none; nothing was run.")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1 is set: unset it to benchmark compiled kernels.")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
    import triton
    from kernels_gpu_tables import print_tables

    device = "cuda"
    name = torch.cuda.get_device_name()
    known_bw, known_flops = device_peaks(name)
    peak_bw = args.peak_bw or known_bw
    peak_flops = args.peak_tflops or known_flops
    if peak_bw is None or peak_flops is None:
        print(f"no known peaks for {name!r}: pass --peak-bw / --peak-tflops for ratios")
    torch.manual_seed(0)
    result = {
        "device": name,
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "peak_bw": peak_bw,
        "peak_tflops": peak_flops,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shapes": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                   "block_size": BLOCK_SIZE, "dtype": str(DTYPE)},
        "decode": [],
        "decode_tiles": [],
        "prefill": [],
    }

    def save() -> None:  # after every section: a run cut short keeps what it measured
        Path(args.out).write_text(json.dumps(result, indent=2))

    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            result["decode"].append(bench_decode(batch, ctx, peak_bw, device))
            print(f"decode batch {batch} ctx {ctx} done", flush=True)
            torch.cuda.empty_cache()
    save()
    batch, ctx, _ = TARGET
    for block_n in (32, 64, 128):
        for num_splits in (1, 2, 4):
            row = bench_decode(
                batch, ctx, peak_bw, device, False, block_n=block_n, num_splits=num_splits
            )
            result["decode_tiles"].append(row)
    torch.cuda.empty_cache()
    save()
    for case in PREFILL_CASES:
        result["prefill"].append(bench_prefill(*case, peak_flops, device))
        print(f"prefill {case} done", flush=True)
        torch.cuda.empty_cache()
    save()

    result["layers"] = bench_layers(device)
    print("fused layers done", flush=True)
    save()
    result["quant_matmul"] = bench_quant_matmul(device)
    print("quantized matmul done", flush=True)
    save()
    torch.cuda.empty_cache()
    result["scaled_matmul"] = bench_scaled_matmul(device)
    print("8-bit weight matmul done", flush=True)
    save()
    torch.cuda.empty_cache()

    if not args.skip_engine:
        from engine_decode_gpu import bench_engine_decode

        result["engine_decode"] = []
        for eager in (False, True):  # CUDA graphs, then eager: what graphs buy
            result["engine_decode"] += bench_engine_decode([1, 16, 64, 256], enforce_eager=eager)
            torch.cuda.empty_cache()
            save()
    save()
    print_tables(result, TARGET)
    for r in result.get("engine_decode", []):
        mode = "graphs" if r["cuda_graphs"] else "eager "
        print(f"engine decode {mode} batch {r['batch']:>4}: {r['tokens_per_s']:>9.0f} tok/s"
              f"  {r['ms_per_step']:.2f} ms/step")
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
