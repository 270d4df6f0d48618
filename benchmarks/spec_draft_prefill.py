"""What the decode worker pays to prefill a draft model locally (draft-model speculation
under disaggregation: docs/architecture.md, "Draft KV under disaggregation").

    PYTHONPATH=. python benchmarks/spec_draft_prefill.py [--prompt-len 512] [--draft DIR]

With a draft model the first proposal for a request computes the draft's KV of the whole
context on the decode worker; later proposals compute only the tail past the last cached
block. This times both, on the proposer alone (``DraftModelProposer.propose``), for
SmolLM2-135M as the target and, unless ``--draft`` names a smaller model of the same
tokenizer, SmolLM2-135M as its own draft (an upper bound: a real draft is smaller). It
also times the target's own prefill of the same prompt, the work the prefill worker does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.spec_decode.base import DraftRequest  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = LLM(dtype="float32", num_blocks=256)
    draft = args.draft or str(target.engine.model_dir)
    llm = LLM(dtype="float32", num_blocks=256,
              speculative_config={"model": draft, "num_speculative_tokens": args.k})
    proposer = llm.engine.spec.proposer
    prompt = [100 + (i * 7919) % 40000 for i in range(args.prompt_len)]
    print(f"load average {os.getloadavg()}, torch threads {torch.get_num_threads()}")

    target.generate([prompt[:16]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    t, c = time.perf_counter(), time.process_time()
    target.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    print(f"target prefill of {args.prompt_len} tokens (+1 token): "
          f"{1000 * (time.perf_counter() - t):.0f} ms wall, "
          f"{1000 * (time.process_time() - c):.0f} ms CPU")
    tokens = list(prompt)
    for step in range(4):
        t, c = time.perf_counter(), time.process_time()
        (proposal,) = proposer.propose([DraftRequest("r", tokens, args.k)])
        what = "first proposal (draft prefill + k decodes)" if step == 0 else "later proposal"
        print(f"{what}: {1000 * (time.perf_counter() - t):.0f} ms wall, "
              f"{1000 * (time.process_time() - c):.0f} ms CPU")
        tokens += proposal.token_ids[:2]  # as if two were accepted


if __name__ == "__main__":
    main()
