"""SmolLM2-135M quantized by ``tandem quantize``: how far greedy output
drifts from float, and what the CPU path costs.

    PYTHONPATH=. python benchmarks/quantized.py [--max-tokens 32] [--only NAME ...]

Quantizes the bundled model (GPTQ 8-bit and AWQ 4-bit, groups of 64: 576,
SmolLM2's width, is not a multiple of 128; compressed-tensors FP8 and INT8,
weight-only and with dynamic per-token inputs; compressed-tensors pack-quantized
4-bit groups of 64 and 8-bit per channel) into a temporary directory, runs
four fixed prompts greedily on each and on the float model, and reports for
each prompt how many leading tokens equal float's, and output tokens per
second. On the CPU the torch reference dequantizes every weight on every
call, so this measures fidelity, not the speed of the GPU kernel.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fidelity import PROMPTS as ALL_PROMPTS  # noqa: E402
from fidelity import leading_matches  # noqa: E402

from engine.quantization.writer import quantize_model  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402

PROMPTS = ALL_PROMPTS[:4]  # the first four: each is run once per scheme


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--only", nargs="*", default=None,
                   help="run float32 and these models only (names as printed)")
    args = p.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        schemes = {  # name: tandem quantize's (method, bits, group size)
            "gptq-8bit-g64": ("gptq", 8, 64),
            "awq-4bit-g64": ("awq", 4, 64),
            # compressed-tensors 8-bit weights (per-channel scales).
            "fp8-w8a16": ("fp8-w8a16", 8, -1),
            "fp8-w8a8": ("fp8", 8, -1),
            "int8-w8a16": ("int8-w8a16", 8, -1),
            "int8-w8a8": ("int8", 8, -1),
            # compressed-tensors pack-quantized integers (symmetric).
            "wna16-4bit-g64": ("wna16", 4, 64),
            "wna16-8bit": ("wna16", 8, -1),
        }
        variants: dict[str, str | None] = {"float32": None}
        for name, how in schemes.items():
            if args.only is None or name in args.only:
                variants[name] = str(quantize_model(None, Path(tmp) / name, *how))
        tokens = {}
        print(f"{'model':<15} {'tok/s':>6}  leading tokens equal to float32 "
              f"(of {args.max_tokens})", flush=True)
        for name, path in variants.items():  # float32 first: the others compare with it
            llm = LLM(path, dtype="float32")
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
            start = time.perf_counter()
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            speed = len(PROMPTS) * args.max_tokens / (time.perf_counter() - start)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            same = [leading_matches(a, b) for a, b in zip(tokens["float32"], tokens[name])]
            print(f"{name:<15} {speed:>6.1f}  {same}", flush=True)


if __name__ == "__main__":
    main()
