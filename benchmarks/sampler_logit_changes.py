"""What a step's per-row logit changes cost the sampler: penalties, a logit
bias, allowed tokens, bad words (``engine/sampler.py``'s
``_apply_penalties_and_bans``), for a batch of rows over a real vocabulary.

    PYTHONPATH=. python benchmarks/sampler_logit_changes.py [--rows 16] [--vocab 49152]
        [--steps 20]

Each arm is a batch of ``--rows`` requests with the same parameters, 100
output tokens each; the time is the median of ``--steps`` calls after a
first one (which may build what a request keeps between steps).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.sampler import _apply_penalties_and_bans  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def arms(vocab: int) -> dict[str, SamplingParams]:
    return {
        "none": SamplingParams(),
        "repetition + frequency penalties": SamplingParams(repetition_penalty=1.1,
                                                           frequency_penalty=0.5),
        "logit_bias, 1024 tokens": SamplingParams(logit_bias={t: -5.0 for t in range(1024)}),
        "allowed_token_ids, 64 tokens": SamplingParams(allowed_token_ids=list(range(64))),
        "allowed_token_ids, the whole vocabulary": SamplingParams(
            allowed_token_ids=list(range(vocab))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab)
    output = list(range(100))
    print(f"{args.rows} rows, vocab {args.vocab}, {torch.get_num_threads()} torch threads; "
          f"ms per step (median of {args.steps})")
    for name, params in arms(args.vocab).items():
        requests = [SimpleNamespace(params=params, token_ids=output, output_token_ids=output,
                                    num_output_tokens=len(output), eos_token_ids=(2,),
                                    bad_word_ids=[]) for _ in range(args.rows)]
        _apply_penalties_and_bans(logits, requests)  # the first step
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            _apply_penalties_and_bans(logits, requests)
            times.append(time.perf_counter() - start)
        print(f"  {name:<42} {statistics.median(times) * 1e3:8.2f}")


if __name__ == "__main__":
    main()
