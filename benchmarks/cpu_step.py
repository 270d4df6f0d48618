"""One CPU decode step (the model's forward and the logits) of N running
requests, with the CPU fast paths on and off, interleaved in one process.

Variants, timed in turn for every repetition so that load from other
processes falls on all of them alike (report medians):

- ``reference``: kernels/reference.py attention and store, ``F.linear``,
  and the reference RMSNorm / rotary / SiLU ops (the state before the CPU
  kernels);
- ``no-pack``: everything but the packed bfloat16 weights;
- ``no-ops``: everything but the fused RMSNorm / rotary / SiLU kernels;
- ``fast``: all of them (the default).

Each line gives the wall time and the process's CPU time per step; with one
thread (``OMP_NUM_THREADS=1``) CPU time is the steadier measure on a shared
machine. The caches are filled with random keys and values; contexts are
``ctx`` +- 16 tokens on shuffled blocks.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/cpu_step.py --dtype bfloat16 \
        --requests 64 --ctx 144 --reps 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import ExitStack, contextmanager

import torch

import engine.layers.cpu_ops as cpu_ops
import engine.layers.packed as packed
from engine.attention import AttentionMetadata
from tandem import LLM


@contextmanager
def patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def variant(name: str, backend) -> ExitStack:
    stack = ExitStack()
    if name == "reference":
        stack.enter_context(patched(backend, "native", False))
    if name in ("reference", "no-pack"):
        stack.enter_context(patched(packed, "_packable", lambda x, w: False))
    if name in ("reference", "no-ops"):
        stack.enter_context(patched(cpu_ops, "supports", lambda x: False))
    return stack


def decode_batch(n: int, ctx: int, block_size: int, num_blocks: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(ctx - 16, ctx + 16, (n,), generator=g, dtype=torch.int32)
    per_seq = (int(seq_lens.max()) + block_size - 1) // block_size
    if n * per_seq >= num_blocks:
        raise ValueError(f"{n} x {per_seq} blocks do not fit in the cache's {num_blocks}")
    tables = (torch.randperm(num_blocks - 1, generator=g)[: n * per_seq] + 1).view(n, per_seq)
    last = seq_lens.long() - 1
    slots = tables.gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size
    starts = torch.arange(n + 1, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=starts, seq_lens=seq_lens,
        block_tables=tables.int(), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
        num_decode_seqs=n, max_query_len=1, max_seq_len=int(seq_lens.max()),
    )
    ids = torch.randint(100, 40000, (n,), generator=g)
    return ids, last, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--ctx", type=int, default=144)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--variants", default="reference,no-pack,no-ops,fast")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="fp8: an 8-bit cache, which the CPU serves through the reference")
    args = p.parse_args()
    llm = LLM(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.engine.runner
    model, caches = runner.model, runner.kv_caches
    g = torch.Generator().manual_seed(1)
    for k, v in caches:  # through float32: fp8 tensors have no normal_
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    ids, positions, meta = decode_batch(args.requests, args.ctx, runner.block_size,
                                        caches[0][0].shape[0])
    backend = model.layers[0].self_attn.backend
    names = args.variants.split(",")
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps + 1):  # the first round warms up
        for name in names:
            with variant(name, backend), torch.inference_mode():
                t, c = time.perf_counter(), time.process_time()
                model.compute_logits(model(ids, positions, caches, meta))
                dt, dc = time.perf_counter() - t, time.process_time() - c
            if rep:
                wall[name].append(dt * 1e3)
                cpu[name].append(dc * 1e3)
    print(f"{args.dtype} (KV {args.kv_cache_dtype}), {args.requests} decodes at ~{args.ctx} tokens, "
          f"{torch.get_num_threads()} threads, {args.reps} reps (median ms per step)")
    for name in names:
        print(f"  {name:10s} wall {statistics.median(wall[name]):7.1f}   "
              f"cpu {statistics.median(cpu[name]):7.1f}")


if __name__ == "__main__":
    main()
