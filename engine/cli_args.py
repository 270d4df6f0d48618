"""Command-line flags for an engine, shared by the workers and the CLI.

Every flag's default is read from the config dataclasses (``default_of``);
each flag's dest is the name of the field it sets, except ``--kv-cache-gib``
(kv_cache_bytes, in GiB).
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from functools import partial

from engine.config import (
    ATTENTION_BACKENDS,
    DTYPE_CHOICES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_of,
    engine_config_from_flat,
)

GIB = 1 << 30
# Fields with no flag of their own name: the nested configs, and kv_cache_bytes
# (--kv-cache-gib).
_NOT_FLAGS = ("cache", "scheduler", "kv_cache_bytes")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    engine = partial(default_of, EngineConfig)
    cache = partial(default_of, CacheConfig)
    sched = partial(default_of, SchedulerConfig)
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=engine("dtype"), choices=DTYPE_CHOICES)
    g.add_argument("--device", default=engine("device"), help="cpu, cuda or cuda:N")
    g.add_argument("--seed", type=int, default=engine("seed"))
    g.add_argument("--load-format", default=engine("load_format"), choices=LOAD_FORMATS,
                   help="dummy: random weights from config.json alone (benchmarks)")
    g.add_argument("--block-size", type=int, default=cache("block_size"))
    g.add_argument("--kv-cache-gib", type=float, default=cache("kv_cache_bytes") / GIB,
                   help="KV cache size on the CPU, in GiB")
    g.add_argument("--gpu-memory-utilization", type=float,
                   default=cache("gpu_memory_utilization"))
    g.add_argument("--num-blocks", type=int, default=cache("num_blocks"),
                   help="override the KV cache size")
    g.add_argument("--prefix-caching", dest="enable_prefix_caching",
                   action=argparse.BooleanOptionalAction,
                   default=cache("enable_prefix_caching"))
    g.add_argument("--kv-cache-dtype", default=cache("kv_cache_dtype"), choices=KV_CACHE_DTYPES,
                   help="store KV in the model's dtype (auto) or in 8 bits (fp8 = fp8_e4m3)")
    g.add_argument("--host-kv-cache-gib", type=float, default=cache("host_kv_cache_gib"),
                   help="keep prefix-cache blocks evicted from the KV cache in this much host "
                        "memory, and copy them back on a hit instead of recomputing")
    g.add_argument("--cpu-offload-gb", type=float, default=engine("cpu_offload_gb"),
                   help="on CUDA, keep this many GB of weights in pinned host memory and "
                        "stream them to the GPU for each forward")
    g.add_argument("--max-model-len", type=int, default=sched("max_model_len"))
    g.add_argument("--max-num-seqs", type=int, default=sched("max_num_seqs"))
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=sched("max_num_batched_tokens"))
    g.add_argument("--max-n", type=int, default=sched("max_n"),
                   help="the most completions one request may ask for")
    g.add_argument("--long-prefill-token-threshold", type=int,
                   default=sched("long_prefill_token_threshold"),
                   help="compute a longer prompt in chunks of at most this many tokens a step, "
                        "so that shorter requests behind it start meanwhile")
    g.add_argument("--attention-backend", default=engine("attention_backend"),
                   choices=ATTENTION_BACKENDS)
    g.add_argument("--quantization", default=engine("quantization"), choices=QUANTIZATIONS,
                   help="insist on a checkpoint quantized this way (default: as it is)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int,
                   default=engine("tensor_parallel_size"),
                   help="split the model across this many processes (GPUs on CUDA)")
    g.add_argument("--nnodes", type=int, default=engine("nnodes"),
                   help="spread the tensor-parallel ranks over this many hosts, "
                        "--tensor-parallel-size / --nnodes on each")
    g.add_argument("--node-rank", type=int, default=engine("node_rank"),
                   help="this host's place among --nnodes: 0 runs the worker (the leader), "
                        "any other only its ranks' model shards")
    g.add_argument("--master-addr", default=engine("master_addr"),
                   help="with --nnodes > 1: the leader's host, where it listens and the other "
                        "nodes reach it (the same on every node)")
    g.add_argument("--master-port", type=int, default=engine("master_port"),
                   help="with --nnodes > 1: the port the leader listens on for the other nodes")
    g.add_argument("--tp-join-timeout", type=float, default=engine("tp_join_timeout"),
                   help="seconds the leader waits for the other nodes' ranks (and they for it) "
                        "before its start fails")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction,
                   default=engine("enforce_eager"),
                   help="on CUDA, run decode steps eagerly instead of replaying CUDA graphs")
    g.add_argument("--speculative-config", type=_speculative_config,
                   default=engine("speculative_config"), metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (decode workers; a prefill worker '
                        'samples one token and never speculates)')


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as exc:  # argparse reports an ArgumentTypeError as a usage error
        raise argparse.ArgumentTypeError(str(exc)) from None


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    flat = {f.name: getattr(args, f.name) for cls in (EngineConfig, CacheConfig, SchedulerConfig)
            for f in fields(cls) if f.name not in _NOT_FLAGS}
    flat["kv_cache_bytes"] = int(args.kv_cache_gib * GIB)
    return engine_config_from_flat(**flat)
