"""How close a bfloat16 prefill step's matmuls come to this CPU's AMX peak,
and whether fusing SwiGLU into oneDNN's matmul pays in the engine.

    PYTHONPATH=. python benchmarks/prefill_matmul_cpu.py [--rows 2048 512] [--reps 7]
        [--engine-reps 8]

Three parts, all with the torch threads this process has (two here):

- **peak**: one core's AMX bf16 throughput with nothing but ``TDPBF16PS``
  on four accumulators from tiles already loaded (a small C loop): the
  ceiling no matmul on this core passes.
- **shapes**: TFLOP/s of ``F.linear`` (oneDNN, the path a prefill takes:
  packed.py sends more than a decode kernel's rows there) for each of
  SmolLM2-135M's four projections, 30 layers' weights (a step's), best of
  ``--reps``.
- **engine**: a 16 x 128-token prefill of the bundled SmolLM2
  (``LLM(dtype="bfloat16")``, one output token), with the MLP as it is
  (``[gate | up]`` by ``F.linear``, then cpu_ops' SiLU-and-mul) and with
  SwiGLU in oneDNN's epilogues (gate with a ``swish`` post-op, then up with
  a ``mul`` post-op by it, on prepacked halves), taken in turn; median ms.
  The fused arm rounds once where the model rounds gate, SiLU and up each to
  bfloat16, so its outputs differ from Hugging Face's in the last bit of
  many elements: it is measured here, not used.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.attention import cbuild  # noqa: E402

# SmolLM2-135M's projections per layer, (out, in): qkv, o, [gate | up], down.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30

_PEAK_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

/* `n` rounds of four 16 x 16 x 32 bf16 tile products into four float32
   accumulators; 0 once done, -1 where AMX is not granted. */
int amx_peak(int64_t n) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return -1;
    static char src[1024] __attribute__((aligned(64)));
    /* NOTE: static, not filled in on the stack: GCC -O3 dropped the stores
       into a stack copy that only ldtilecfg reads (tiles of 0 rows: #UD). */
    static const tile_config cfg __attribute__((aligned(64))) = {
        .palette = 1,
        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
    };
    _tile_loadconfig(&cfg);
    _tile_loadd(4, src, 64); _tile_loadd(5, src, 64); _tile_loadd(6, src, 64); _tile_loadd(7, src, 64);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t i = 0; i < n; i++) {
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_release();
    return 0;
#else
    return -1;
#endif
}
"""


def amx_peak_tflops(rounds: int = 20_000_000) -> float | None:
    """One core's TFLOP/s of back-to-back tile products, or None without AMX."""
    import ctypes

    lib = cbuild.load("amx_peak", _PEAK_SOURCE)
    if lib is None:
        return None
    lib.amx_peak.argtypes = [ctypes.c_int64]
    if lib.amx_peak(1000) != 0:
        return None
    start = time.perf_counter()
    lib.amx_peak(rounds)
    return 4 * rounds * 16 * 16 * 32 * 2 / (time.perf_counter() - start) / 1e12


def shape_tflops(rows: int, reps: int) -> list[float]:
    """Best TFLOP/s over ``reps`` of each projection's 30 layers by F.linear."""
    weights = [[torch.randn(o, i, dtype=torch.bfloat16) * 0.05 for o, i in SHAPES]
               for _ in range(LAYERS)]
    inputs = [torch.randn(rows, i, dtype=torch.bfloat16) for _, i in SHAPES]
    best = [0.0] * len(SHAPES)
    for _ in range(reps):
        for j, (o, i) in enumerate(SHAPES):
            start = time.perf_counter()
            for layer in weights:
                F.linear(inputs[j], layer[j])
            best[j] = max(best[j], 2 * rows * o * i * LAYERS / (time.perf_counter() - start) / 1e12)
    return best


def fused_swiglu(original):
    """``MLP.forward`` with SwiGLU in oneDNN's epilogues for prefill-sized
    bfloat16 batches (``original`` otherwise)."""
    packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(mlp, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] <= 128 or x.dtype != torch.bfloat16:
            return original(mlp, x)
        halves = packed.get(id(mlp))
        if halves is None:
            weight = mlp.gate_up_proj.weight.detach()
            inner = weight.shape[0] // 2
            halves = packed[id(mlp)] = tuple(
                torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
                for w in (weight[:inner], weight[inner:]))
        gate = torch.ops.mkldnn._linear_pointwise(x, halves[0], None, "swish", [], "")
        h = torch.ops.mkldnn._linear_pointwise.binary(x, gate, halves[1], None, "mul")
        return mlp.tp.all_reduce(mlp.down_proj(h))

    return forward


def engine_ms(reps: int) -> dict[str, float]:
    from engine.models import llama
    from tandem import LLM, SamplingParams

    llm = LLM(dtype="bfloat16")
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    forwards = {"as it is": llama.MLP.forward, "SwiGLU in oneDNN": fused_swiglu(llama.MLP.forward)}

    def step() -> float:
        prompts = [[rng.randrange(100, 49000) for _ in range(128)] for _ in range(16)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in forwards}
    try:
        for forward in forwards.values():  # warm-up, the fused arm's packing included
            llama.MLP.forward = forward
            step()
        for _ in range(reps):
            for name, forward in forwards.items():
                llama.MLP.forward = forward
                times[name].append(step())
    finally:
        llama.MLP.forward = forwards["as it is"]
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2048, 512])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--engine-reps", type=int, default=8, help="0: skip the engine part")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    peak = amx_peak_tflops()
    print(f"AMX peak: {'no AMX here' if peak is None else f'{peak:.2f} TFLOP/s per core'}; "
          f"{threads} torch threads")
    for rows in args.rows:
        cells = shape_tflops(rows, args.reps)
        line = " | ".join(f"{o}x{i} {t:.2f}" for (o, i), t in zip(SHAPES, cells))
        share = "" if peak is None else \
            f" ({max(cells) / (peak * threads):.0%} of {threads} cores' peak at best)"
        print(f"F.linear, {rows} rows, TFLOP/s: {line}{share}")
    if args.engine_reps:
        ms = engine_ms(args.engine_reps)
        print("16 x 128-token prefill, median ms: "
              + ", ".join(f"{name} {v:.1f}" for name, v in ms.items()))


if __name__ == "__main__":
    main()
