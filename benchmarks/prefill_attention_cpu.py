"""One layer's prefill attention on the CPU, three ways, interleaved.

    PYTHONPATH=. python benchmarks/prefill_attention_cpu.py [--reps 10] [--rounds 3]
        [--shapes 16x128,4x512,1x2048] [--cached 0] [--dtype bfloat16]
        [--threads 1 --clock cpu] [--arms "C kernel,AMX"]

SmolLM2-135M's heads (9 query heads, 3 kv heads, head_dim 64), a paged
cache of 16-token blocks in a shuffled order. For each shape (sequences x
new tokens, each after ``--cached`` cached tokens): the C kernel of
``cpu_attention.paged_attention`` (per-row dot products), SDPA over each
sequence's gathered blocks (``cpu_attention.prefill_sdpa``) and the AMX
kernel (``amx_prefill.prefill``; with ``--dtype float32``, the "f32" arm,
``f32_prefill.prefill``, in its place), taken in turn within each round so a
change of the machine's load hits all three alike. ms per call, median over
the rounds of the mean of ``--reps`` calls; ``uptime`` before and after.
On a shared machine, ``--threads 1 --clock cpu`` (one thread's CPU time)
compares the arms' work without the other processes' share of the cores.
Where the C kernel hands over to the AMX kernel (``TILE_FROM`` in
torch_backend.py) was measured with short chunks after cached tokens:
``--shapes 16x8,16x12,16x16,16x24,16x32 --cached 256 --arms "C kernel,AMX"``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.attention import amx_prefill, cpu_attention, f32_prefill  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def case(num_seqs: int, new: int, cached: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    seq_len = cached + new
    per_seq = -(-seq_len // BLOCK)
    blocks = num_seqs * per_seq
    shape = (blocks, BLOCK, KV_HEADS, DIM)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    table = torch.randperm(blocks, generator=g).to(torch.int32).view(num_seqs, per_seq)
    query = torch.randn(num_seqs * new, HEADS, DIM, generator=g).to(dtype)
    qsl = torch.arange(0, num_seqs * new + 1, new, dtype=torch.int32)
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    return query, k_cache, v_cache, table, qsl, lens


def arms(args):
    query, *rest = args
    out = torch.empty_like(query)
    yield "C kernel", lambda: cpu_attention.paged_attention(query, *rest, DIM ** -0.5, out=out)
    yield "SDPA", lambda: cpu_attention.prefill_sdpa(query, *rest, DIM ** -0.5, out, 1)
    if query.dtype == torch.bfloat16 and amx_prefill.available():
        yield "AMX", lambda: amx_prefill.prefill(query, *rest, DIM ** -0.5, out)
    if query.dtype == torch.float32 and f32_prefill.available():
        yield "f32", lambda: f32_prefill.prefill(query, *rest, DIM ** -0.5, out)


def mean_ms(fn, reps: int, clock) -> float:
    start = clock()
    for _ in range(reps):
        fn()
    return (clock() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default="16x128,4x512,1x2048")
    parser.add_argument("--cached", type=int, default=0)
    parser.add_argument("--arms", default="C kernel,SDPA,AMX,f32",
                        help="comma-separated subset of: C kernel, SDPA, AMX (bfloat16), "
                             "f32 (float32)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's threads; with 1, --clock cpu times the work alone")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this thread's CPU time (with --threads 1, blind to other load)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"threads {torch.get_num_threads()}, {args.clock} clock, {args.dtype}, "
          f"AMX kernel {amx_prefill.available()}, f32 kernel {f32_prefill.available()}")
    for spec in args.shapes.split(","):
        num_seqs, new = (int(x) for x in spec.split("x"))
        tensors = case(num_seqs, new, args.cached, getattr(torch, args.dtype))
        wanted = args.arms.split(",")
        fns = {name: fn for name, fn in arms(tensors) if name in wanted}
        for fn in fns.values():
            fn()  # build, warm
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(mean_ms(fn, args.reps, clock))
        flops = 4 * HEADS * DIM * num_seqs * sum(args.cached + j + 1 for j in range(new))
        cells = [f"{name} {statistics.median(t):.2f} ms "
                 f"({flops / statistics.median(t) / 1e6:.0f} GFLOPS)" for name, t in times.items()]
        print(f"{num_seqs} x {new} (+{args.cached} cached): " + ", ".join(cells))
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
