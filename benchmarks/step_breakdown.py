"""Where one decode step of the bundled SmolLM2 goes, end to end through
``LLMEngine.step()``.

    PYTHONPATH=. .venv/bin/python benchmarks/step_breakdown.py [--requests 64] [--dtype auto]
        [--prompt-len 128] [--decode-kernel-max-rows 128]

N requests of 128 random tokens are prefilled, then decode steps are timed
(with ``--prompt-len``, each timed step also takes a new prompt of that many
tokens: a served step where a request arrives; ``--decode-kernel-max-rows``
sets the row count up to which bfloat16 matmuls take the decode kernel)
as they are, and again with each hot function wrapped in a timer (the
matmuls, attention, the norm/rotary/SiLU kernels, the LM head and
sampling; the C kernels run outside torch, so torch's profiler cannot name
them). The wrapped functions' times are wall time inside them, summed over
the step; the wrappers themselves add a few microseconds a call.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine.model_runner as model_runner  # noqa: E402
from engine.attention import amx_prefill, cpu_attention, f32_prefill  # noqa: E402
from engine.layers import cpu_ops, packed  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402

FIRST_PLAIN_TOKEN = 100  # SmolLM2's special tokens sit below this


def timed(totals: Counter, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-len", type=int, default=0)
    ap.add_argument("--decode-kernel-max-rows", type=int, default=0)
    args = ap.parse_args()

    engine = LLM(dtype=args.dtype).engine
    kernel = packed._decode_kernel()
    if args.decode_kernel_max_rows and kernel is not None:
        kernel.MAX_ROWS = args.decode_kernel_max_rows
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=4 * args.steps + 16, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)  # done in its own step
    for i in range(args.requests):
        engine.add_request(f"r{i}", [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(128)],
                           params)
    started: set[str] = set()
    while len(started) < args.requests:  # the prefills
        started.update(out.request_id for out in engine.step())

    def ms_per_step() -> float:
        seconds = 0.0
        for _ in range(args.steps):
            if args.prompt_len:
                engine.add_request(f"p{rng.random()}", [rng.randrange(FIRST_PLAIN_TOKEN, vocab)
                                                        for _ in range(args.prompt_len)], one)
            t = time.perf_counter()
            engine.step()
            seconds += time.perf_counter() - t
        return seconds / args.steps * 1e3

    whole = ms_per_step()
    totals: Counter = Counter()
    # A benchmark may look inside: wrap the hot functions where their callers find them.
    cpu_attention.paged_attention = timed(totals, "attention (C kernel)",
                                          cpu_attention.paged_attention)
    cpu_attention.store_kv = timed(totals, "store new keys/values", cpu_attention.store_kv)
    # A prompt's attention, from --prompt-len up (a tile kernel, or SDPA without one).
    for tiles in (amx_prefill, f32_prefill):
        tiles.prefill = timed(totals, "prompt attention (tiles)", tiles.prefill)
    cpu_attention.prefill_sdpa = timed(totals, "prompt attention (SDPA)", cpu_attention.prefill_sdpa)
    for name in ("rms_norm", "silu_and_mul", "rotary_"):
        setattr(cpu_ops, name, timed(totals, name, getattr(cpu_ops, name)))
    packed.PackedWeight.linear = timed(totals, "matmuls (with the LM head)",
                                       packed.PackedWeight.linear)
    model = engine.runner.model
    model.compute_logits = timed(totals, "  of which the LM head", model.compute_logits)
    model_runner.sample = timed(totals, "sampling", model_runner.sample)
    wrapped = ms_per_step()

    print(f"{args.requests} running requests, dtype {engine.config.dtype}, context "
          f"{129}-{129 + 2 * args.steps} tokens"
          + (f", a new {args.prompt_len}-token prompt in each step" if args.prompt_len else "")
          + (f", decode kernel up to {kernel.MAX_ROWS} rows" if kernel is not None else ""))
    print(f"{'step':<40}{whole:>8.1f} ms")
    print(f"{'step with the timers':<40}{wrapped:>8.1f} ms")
    head = totals.pop("  of which the LM head")
    for name, seconds in totals.most_common():
        print(f"{'  ' + name:<40}{seconds / args.steps * 1e3:>8.1f} ms")
        if name.startswith("matmuls"):
            print(f"{'    of which the LM head':<40}{head / args.steps * 1e3:>8.1f} ms")
    rest = wrapped - sum(totals.values()) / args.steps * 1e3
    print(f"{'  the rest (Python, scheduling, output)':<40}{rest:>8.1f} ms")


if __name__ == "__main__":
    main()
