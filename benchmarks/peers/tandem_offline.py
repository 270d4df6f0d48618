"""One offline run of Tandem ``LLM.generate`` on a workload file; ``compare.py`` starts it.

    .venv/bin/python benchmarks/peers/tandem_offline.py --model DIR --workload W.json \\
        --dtype float32 --repeat 1 --out R.json

Greedy, ``ignore_eos``, every request its own fixed output length, all handed to one
``generate`` call. A short warm-up first; each repetition is timed on its own. Writes the wall
seconds of each repetition and the output token ids of the first to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    from tandem import LLM, SamplingParams

    work = json.loads(args.workload.read_text())
    prompts, lens = work["prompts"], work["output_lens"]
    t0 = time.perf_counter()
    # NOTE: no prefix caching, in either system: a repetition would otherwise
    # find the last one's prompts cached and skip their prefill.
    llm = LLM(args.model, dtype=args.dtype, device="cpu", enable_prefix_caching=False)
    startup = time.perf_counter() - t0

    def once(ps, ns):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in ns]
        start = time.perf_counter()
        outs = llm.generate(ps, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if [len(t) for t in tokens] != list(ns):
            raise RuntimeError("tandem produced the wrong number of tokens")
        return elapsed, tokens

    once([list(range(100, 116))] * 2, [4, 4])  # warm-up
    times, first = [], None
    for _ in range(args.repeat):
        elapsed, tokens = once(prompts, lens)
        times.append(elapsed)
        first = first or tokens
        print(f"tandem {args.dtype}: {sum(lens) / elapsed:.1f} output tok/s", flush=True)
    args.out.write_text(json.dumps({
        "system": "tandem", "dtype": args.dtype, "startup_s": startup, "times_s": times,
        "output_tokens": sum(lens), "tokens": first,
        "versions": {"torch": torch.__version__}, "torch_threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
