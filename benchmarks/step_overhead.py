"""Host overhead of one engine step against the model's forward time.

With 256 requests all decoding, times separately, per step:
``scheduler.schedule()``, ``engine.batch.flatten`` (flattening the batch
into tensors), the model's forward and sampling, and ``scheduler.update`` +
output processing. The model is SmolLM2-135M's architecture with random
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

from engine.batch import flatten
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

    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        flatten(out, runner.block_size)[0].to_device(runner.device)  # timed alone; execute() again
        sync()
        t2 = time.perf_counter()
        result = runner.execute(out)
        sync()
        t3 = time.perf_counter()
        changed = sched.update(out, result.sampled)
        engine.outputs.process(changed)
        t4 = time.perf_counter()
        assert out.num_decodes == len(out.scheduled) == engine.scheduler.num_running
        times["schedule"].append(t1 - t0)
        times["prepare"].append(t2 - t1)
        times["execute"].append(t3 - t2)
        times["update"].append(t4 - t3)
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
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running
    ):
        engine.step()  # the prefills
    measure(engine, 3, args.device)  # warm up
    times = measure(engine, args.steps, args.device)

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    forward = med["execute"] - med["prepare"]
    host = med["schedule"] + med["prepare"] + med["update"]
    print(f"{args.size} on {args.device}: {args.num_requests} decoding requests, "
          f"median of {args.steps} steps")
    print(f"{'part':<34}{'ms/step':>10}")
    rows = [
        ("scheduler.schedule()", med["schedule"]),
        ("flatten() + to_device()", med["prepare"]),
        ("scheduler.update() + outputs", med["update"]),
        ("host overhead (sum of the above)", host),
        ("forward + sampling", forward),
    ]
    for name, ms in rows:
        print(f"{name:<34}{ms:>10.3f}")
    print(f"host overhead = {100 * host / forward:.1f}% of the forward")


if __name__ == "__main__":
    main()
