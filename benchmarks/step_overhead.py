"""Host overhead of one engine step against the model's forward time.

With 256 requests all decoding, times separately, per step:
``scheduler.schedule()``, the runner's input preparation (applying the
step's deltas to its persistent batch, flattening it into tensors), the
model's forward and sampling, and ``scheduler.update`` + output processing. The model is SmolLM2-135M's architecture with random
weights (nothing is downloaded), or a tiny one with ``--size tiny``.

    PYTHONPATH=. python benchmarks/step_overhead.py [--size smollm2|tiny] [--device cpu]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tandem.llm import engine_config

SIZES = {
    # SmolLM2-135M: hidden 576, 30 layers, 9 heads / 3 kv heads, vocab 49152.
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2),
}


def build_model(size: str, path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=2048, rms_norm_eps=1e-5,
                      rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def measure(engine: LLMEngine, steps: int, device: str) -> dict[str, list[float]]:
    sched, runner = engine.scheduler, engine.runner
    times: dict[str, list[float]] = {k: [] for k in ("schedule", "prepare", "execute", "update")}

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    batch = runner.input_batch
    prepare = batch.prepare

    def timed_prepare(out):  # inside execute(): apply deltas, flatten, move to the device
        t = time.perf_counter()
        step, rows = prepare(out)
        step.to_device(runner.device)
        sync()
        times["prepare"].append(time.perf_counter() - t)
        return step, rows

    batch.prepare = timed_prepare
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            result = runner.execute(out)
            sync()
            t2 = time.perf_counter()
            engine._process(sched.update(out, result))
            t3 = time.perf_counter()
            assert out.num_decodes == len(out.scheduled) == engine.stats().num_running
            times["schedule"].append(t1 - t0)
            times["execute"].append(t2 - t1)
            times["update"].append(t3 - t2)
    finally:
        batch.prepare = prepare
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="smollm2")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.size, Path(tmp) / args.size)
        max_len = args.prompt_len + args.steps + 16
        blocks = args.num_requests * (-(-max_len // 16) + 1)
        engine = LLMEngine(engine_config(
            str(model_dir), device=args.device, block_size=16, num_blocks=blocks,
            max_num_seqs=args.num_requests, max_num_batched_tokens=8192,
        ))
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(args.num_requests):
        engine.add_request(f"r{i}", [rng.randrange(3, 500) for _ in range(args.prompt_len)],
                           params)
    started: set[str] = set()
    while len(started) < args.num_requests:  # the prefills, until each has its first token
        started.update(out.request_id for out in engine.step())
    measure(engine, 3, args.device)  # warm up
    times = measure(engine, args.steps, args.device)

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    forward = med["execute"] - med["prepare"]  # execute() includes the preparation
    host = med["schedule"] + med["prepare"] + med["update"]
    print(f"{args.size} on {args.device}: {args.num_requests} decoding requests, "
          f"median of {args.steps} steps")
    print(f"{'part':<34}{'ms/step':>10}")
    rows = [
        ("scheduler.schedule()", med["schedule"]),
        ("input batch + to_device()", med["prepare"]),
        ("scheduler.update() + outputs", med["update"]),
        ("host overhead (sum of the above)", host),
        ("forward + sampling", forward),
    ]
    for name, ms in rows:
        print(f"{name:<34}{ms:>10.3f}")
    print(f"host overhead = {100 * host / forward:.1f}% of the forward")


if __name__ == "__main__":
    main()
