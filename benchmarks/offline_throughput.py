"""Offline throughput on SmolLM2-135M: Tandem ``LLM.generate`` against Hugging Face ``generate``.

    PYTHONPATH=. python benchmarks/offline_throughput.py [--num-requests 8] [--seed 0]

One process, one seeded workload of random-token prompts (lengths drawn from [32, 512]) and
output lengths (drawn from [16, 256]), every request greedy with ``ignore_eos`` so each produces
exactly its output length. Three systems run it in turn, each after a short warm-up:

    tandem      all requests handed to ``LLM.generate`` at once (continuous batching, paged KV)
    hf-serial   ``model.generate`` one request at a time
    hf-static   ``model.generate`` on static batches in workload order, left-padded; a batch
                runs until its longest output is done, and only each request's own output
                tokens are counted

Throughput is output tokens per second of wall time. Both sides read the same float32 weights
(the bundled GGUF, converted once by Tandem's loader) and run on the CPU by default. The workload
hash (sha256 of the prompt and length lists) identifies the workload across runs and machines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.loader.resolve import resolve_model_dir  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402

# SmolLM2's special tokens sit at the start of the vocabulary; random prompts avoid them.
FIRST_PLAIN_TOKEN = 100


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def sha256(self) -> str:
        blob = json.dumps({"prompts": self.prompts, "output_lens": self.output_lens})
        return hashlib.sha256(blob.encode()).hexdigest()


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    prompts, output_lens = [], []
    for _ in range(args.num_requests):
        length = rng.randint(args.min_prompt_len, args.max_prompt_len)
        prompts.append([rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(length)])
        output_lens.append(rng.randint(args.min_output_len, args.max_output_len))
    return Workload(prompts, output_lens)


def run_tandem(llm: LLM, work: Workload) -> tuple[float, list[list[int]]]:
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(work.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    if [len(t) for t in tokens] != work.output_lens:
        raise RuntimeError("tandem produced the wrong number of tokens")
    return elapsed, tokens


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy, left-padded, exactly ``max_new_tokens`` tokens per row."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    out = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
    )
    if out.shape[1] != width + max_new_tokens:
        raise RuntimeError("hugging face stopped early")
    return out[:, width:].tolist()


def run_hf_serial(model, work: Workload) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens = [hf_generate(model, [p], n)[0] for p, n in zip(work.prompts, work.output_lens)]
    return time.perf_counter() - start, tokens


def run_hf_static(model, work: Workload, batch_size: int) -> tuple[float, list[list[int]]]:
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        lens = work.output_lens[i : i + batch_size]
        rows = hf_generate(model, work.prompts[i : i + batch_size], max(lens))
        tokens += [row[:n] for row, n in zip(rows, lens)]
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--hf-batch-size", type=int, default=4, help="static batch size")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--systems", default="tandem,hf-serial,hf-static",
        help="comma-separated subset of tandem, hf-serial, hf-static",
    )  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    systems = args.systems.split(",")
    if unknown := set(systems) - {"tandem", "hf-serial", "hf-static"}:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")

    model_dir = resolve_model_dir(args.model)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    work = make_workload(args, vocab_size)
    prompt_lens = [len(p) for p in work.prompts]
    print(f"model       {model_dir}")
    print(f"machine     {platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, cpu")  # fmt: skip
    print(f"workload    {args.num_requests} requests, seed {args.seed}, prompt tokens "
          f"{sum(prompt_lens)} ({min(prompt_lens)}-{max(prompt_lens)}), output tokens "
          f"{work.num_output_tokens} ({min(work.output_lens)}-{max(work.output_lens)})")  # fmt: skip
    print(f"sha256      {work.sha256}")
    print(f"load avg    {os.getloadavg()[0]:.2f} at start (other processes share these cores)")

    results: dict[str, tuple[float, list[list[int]]]] = {}
    warm = Workload([list(range(FIRST_PLAIN_TOKEN, FIRST_PLAIN_TOKEN + 16))] * 2, [4, 4])
    if "tandem" in systems:
        llm = LLM(str(model_dir), dtype="float32", device="cpu")
        run_tandem(llm, warm)
        results["tandem"] = run_tandem(llm, work)
        print(f"tandem      {results['tandem'][0]:.1f}s", flush=True)
        stats = llm.engine.stats()
        if stats.num_free_blocks != stats.num_blocks:
            raise RuntimeError("tandem leaked KV blocks")
        del llm
    if {"hf-serial", "hf-static"} & set(systems):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        # NOTE: the equivalent of ignore_eos. min_new_tokens would not do: it bans EOS from
        # being chosen, where ignore_eos lets the model choose it and carries on.
        model.generation_config.eos_token_id = None
        run_hf_static(model, warm, 2)
        if "hf-serial" in systems:
            results["hf-serial"] = run_hf_serial(model, work)
            print(f"hf-serial   {results['hf-serial'][0]:.1f}s", flush=True)
        if "hf-static" in systems:
            results["hf-static"] = run_hf_static(model, work, args.hf_batch_size)
            print(f"hf-static   {results['hf-static'][0]:.1f}s", flush=True)

    reference = results.get("hf-serial")
    print(f"load avg    {os.getloadavg()[0]:.2f} at end")
    print()
    print("| system | wall s | output tok/s | tandem speedup | same tokens as hf-serial |")
    print("|---|---:|---:|---:|---:|")
    for name, (seconds, tokens) in results.items():
        label = f"hf-static (batch {args.hf_batch_size})" if name == "hf-static" else name
        rate = work.num_output_tokens / seconds
        speedup = f"{seconds / results['tandem'][0]:.2f}x" if "tandem" in results else "-"
        same = "-"
        if reference is not None:
            agree = sum(a == b for a, b in zip(tokens, reference[1]))
            same = f"{agree}/{len(tokens)}"
        print(f"| {label} | {seconds:.1f} | {rate:.1f} | {speedup} | {same} |")
    if reference is not None:
        for name, (_, tokens) in results.items():
            for i, (ours, ref) in enumerate(zip(tokens, reference[1])):
                if ours != ref:
                    at = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
                    print(f"{name}: request {i} leaves hf-serial's greedy path at output "
                          f"token {at} of {len(ref)}")  # fmt: skip


if __name__ == "__main__":
    main()
