"""End-to-end decode throughput of the engine on a random-weight
Llama-3-8B-shaped model (no download: weights are random, load_format=dummy).

    python benchmarks/engine_decode_gpu.py [--batches 1 16 64 256] [--out engine_decode.json]

For each batch size: B prompts of --prompt-len random tokens, --output-len
tokens each (ignore_eos), with decode steps replayed from CUDA graphs
(or eagerly with --enforce-eager). Reports decode tokens/s over the steps after every
request has its first token (prefill excluded), and the mean step time.
Needs CUDA; also imported by kernels_gpu.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}


def bench_engine_decode(batches: list[int], prompt_len: int = 128, output_len: int = 128,
                        device: str = "cuda", enforce_eager: bool = False) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from tandem import LLM, SamplingParams

    model_dir = Path(tempfile.mkdtemp(prefix="llama3-8b-shape-"))
    (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    llm = LLM(str(model_dir), load_format="dummy", device=device, dtype="bfloat16",
              max_num_seqs=max(batches), max_num_batched_tokens=8192,
              max_model_len=prompt_len + output_len + 16, gpu_memory_utilization=0.85,
              enforce_eager=enforce_eager)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    rows = []
    for batch in batches:
        for i in range(batch):
            prompt = [rng.randrange(1000, 100000) for _ in range(prompt_len)]
            engine.add_request(f"b{batch}-{i}", prompt, params)
        decode_start, decode_tokens, steps = None, 0, 0
        started: set[str] = set()
        while engine.has_unfinished_requests():
            outs = engine.step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if decode_start is None:
                started.update(o.request_id for o in outs)
                if len(started) == batch:  # every prompt is in: decoding from here
                    decode_start = time.perf_counter()
                continue
            steps += 1
            decode_tokens += sum(len(o.outputs[0].delta_token_ids) for o in outs)
        elapsed = time.perf_counter() - decode_start if decode_start else float("nan")
        rows.append({"batch": batch, "cuda_graphs": not enforce_eager,
                     "decode_tokens": decode_tokens, "steps": steps,
                     "seconds": elapsed, "tokens_per_s": decode_tokens / elapsed,
                     "ms_per_step": 1000 * elapsed / max(steps, 1)})
        mode = "eager" if enforce_eager else "graphs"
        print(f"engine decode ({mode}) batch {batch}: {rows[-1]['tokens_per_s']:.0f} tok/s, "
              f"{rows[-1]['ms_per_step']:.2f} ms/step", flush=True)
    # Hand the KV cache's memory back, so that a second run in this process
    # (kernels_gpu.py runs graphs, then eager) can size its own.
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out", default="engine_decode.json")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("engine_decode_gpu.py needs a CUDA GPU; nothing was run.")
    rows = bench_engine_decode(args.batches, args.prompt_len, args.output_len,
                               enforce_eager=args.enforce_eager)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
