"""Time to first token of a short request queued behind one long prompt.

    PYTHONPATH=. python benchmarks/long_prompt_ttft.py [--long 8000] [--short 32]
        [--threshold 512 --threshold none] [--dtype auto]

One engine (the bundled SmolLM2-135M-Instruct), one long random-token prompt
added first and stepped once, then a short one; the clock runs from the
short request's arrival to its first token. Each ``--threshold`` value
(``long_prefill_token_threshold``; ``none``: a prompt may take the whole
step budget) is measured in a fresh engine, so the prefix cache never helps.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem import LLM, SamplingParams  # noqa: E402

FIRST_PLAIN_TOKEN = 100  # SmolLM2's special tokens sit below this


def measure(threshold: int | None, long_len: int, short_len: int, dtype: str) -> dict:
    llm = LLM(dtype=dtype, long_prefill_token_threshold=threshold, max_model_len=long_len + 64)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request("warm", prompt(16), one)  # first-step costs out of the timing
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    engine.add_request("long", prompt(long_len), one)
    engine.step()
    added = time.perf_counter()
    engine.add_request("short", prompt(short_len), one)
    short_ttft = long_ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id == "short" and short_ttft is None:
                short_ttft = now - added
            if out.request_id == "long" and long_ttft is None:
                long_ttft = now - start
    return {"threshold": threshold, "short_ttft_s": short_ttft, "long_ttft_s": long_ttft,
            "dtype": engine.config.dtype}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=8000)
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--threshold", action="append", default=None,
                    help="long_prefill_token_threshold to try (repeatable; 'none' for off)")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    thresholds = [None if t == "none" else int(t) for t in (args.threshold or ["512", "none"])]
    print(f"{'threshold':>10} {'short TTFT s':>13} {'long TTFT s':>12}  dtype")
    for t in thresholds:
        r = measure(t, args.long, args.short, args.dtype)
        print(f"{str(t):>10} {r['short_ttft_s']:>13.2f} {r['long_ttft_s']:>12.2f}  {r['dtype']}",
              flush=True)


if __name__ == "__main__":
    main()
