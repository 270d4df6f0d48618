"""One offline run of vLLM ``LLM.generate`` on a workload file, in vLLM's own venv;
``compare.py`` starts it.

    .peers/vllm-venv/bin/python benchmarks/peers/vllm_offline.py --model DIR \\
        --workload W.json --dtype float32 --repeat 1 --out R.json [--enforce-eager]

The same contract as ``tandem_offline.py``: prompts as token ids, greedy, ``ignore_eos``,
fixed output lengths, a warm-up, each repetition timed on its own. Only vLLM and the standard
library are imported. The process exits normally: vLLM's engine-core processes are shut down
by its own exit handlers (``os._exit`` would orphan them).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    work = json.loads(args.workload.read_text())
    prompts, lens = work["prompts"], work["output_lens"]
    longest = max(len(p) + n for p, n in zip(prompts, lens))
    t0 = time.perf_counter()
    # NOTE: no prefix caching, in either system (see tandem_offline.py).
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=args.enforce_eager, seed=0,
              max_model_len=max(2048, longest), enable_prefix_caching=False)
    startup = time.perf_counter() - t0

    def once(ps, ns):
        inputs = [{"prompt_token_ids": p} for p in ps]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in ns]
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if [len(t) for t in tokens] != list(ns):
            raise RuntimeError("vLLM produced the wrong number of tokens")
        return elapsed, tokens

    once([list(range(100, 116))] * 2, [4, 4])  # warm-up
    times, first = [], None
    for _ in range(args.repeat):
        elapsed, tokens = once(prompts, lens)
        times.append(elapsed)
        first = first or tokens
        print(f"vllm {args.dtype}: {sum(lens) / elapsed:.1f} output tok/s", flush=True)
    args.out.write_text(json.dumps({
        "system": "vllm", "dtype": args.dtype, "startup_s": startup, "times_s": times,
        "output_tokens": sum(lens), "tokens": first, "enforce_eager": args.enforce_eager,
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
