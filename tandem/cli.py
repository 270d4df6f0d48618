"""The ``tandem`` command line.

    tandem generate "The capital of France is" --max-tokens 32
    tandem quantize smollm2-gptq8 --bits 8 --group-size 64

One function per subcommand (``_generate``), registered in ``build_parser``
with its arguments; a new subcommand is one more ``_add_<name>`` and
function. Heavy imports (torch, the engine) happen inside the command, so
``tandem --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from engine.quantization.compressed_config import PACKED_SCHEMES, SCHEMES

Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: LLM inference with a paged KV cache."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_quantize(sub)
    from tandem import bench, up

    up.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command: Command = args.run
    try:
        return command(args)
    except (ValueError, FileNotFoundError) as exc:  # bad input: a message, not a traceback
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# ---- tandem generate ---------------------------------------------------------------


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt with a model in this process",
                       description="Complete PROMPT and print the completion as it is generated.")
    p.add_argument("prompt", help="the text to complete")
    p.add_argument("--model", default=None,
                   help="model directory (config.json + safetensors) or .gguf file; "
                        "default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (the default) is greedy decoding")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model across this many processes (GPUs on CUDA)")
    p.set_defaults(run=_generate)


def _generate(args: argparse.Namespace) -> int:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        seed=args.seed,
    )
    device = args.device or _default_device()
    from tandem.llm import LLM

    llm = LLM(args.model, device=device, tensor_parallel_size=args.tensor_parallel_size)
    engine = llm.engine
    try:
        engine.add_request("cli", args.prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        engine.shutdown()
    return 0


# ---- tandem quantize ---------------------------------------------------------------


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize", help="write a model's linear layers as GPTQ/AWQ integers or FP8/INT8",
        description="Quantize a float model into the GPTQ or AWQ file format by "
                    "round-to-nearest per group (the formats, not their calibration "
                    "algorithms); into compressed-tensors pack-quantized integers "
                    "(wna16: symmetric, wna16-asym: with zero points; --bits 4 or 8, "
                    "--group-size -1 for one scale per output channel); or into "
                    "compressed-tensors 8-bit weights with absmax scales (fp8 = FP8 W8A8 "
                    "dynamic, fp8-w8a16, fp8-tensor, int8 = INT8 W8A8 dynamic, int8-w8a16). "
                    "The result loads like any other model directory.")
    p.add_argument("out", help="the directory to create")
    p.add_argument("--model", default=None,
                   help="model directory or .gguf file; default: the bundled SmolLM2")
    p.add_argument("--method", default="gptq",
                   choices=["gptq", "awq", *PACKED_SCHEMES, *SCHEMES])
    p.add_argument("--bits", type=int, default=4, help="4, or 8 (GPTQ and wna16 only)")
    p.add_argument("--group-size", type=int, default=128,
                   help="input rows per scale and zero point; -1: one group per row")
    p.set_defaults(run=_quantize)


def _quantize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.quantization.writer import quantize_model

    out = quantize_model(args.model, Path(args.out), args.method, args.bits, args.group_size)
    print(f"wrote {out}")
    return 0


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main())
