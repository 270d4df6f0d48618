"""Command-line flags for an engine, shared by the workers and the CLI."""

from __future__ import annotations

import argparse

from engine.config import CacheConfig, EngineConfig, SchedulerConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV cache size on the CPU, in GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-blocks", type=int, default=None, help="override the KV cache size")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--quantization", default=None, choices=["gptq", "awq"],
                   help="insist on a checkpoint quantized this way (default: as it is)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model across this many processes (GPUs on CUDA)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run decode steps eagerly instead of replaying CUDA graphs")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_blocks=args.num_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
        ),
    )
