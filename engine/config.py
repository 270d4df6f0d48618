"""Engine configuration: frozen, validated at construction, passed explicitly."""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.quantization import CompressedConfig, QuantConfig, quant_config_from_dict
from engine.spec_config import SpeculativeConfig  # noqa: F401  (part of the config API)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

# The dtype names an engine runs in, with their bytes per element: the one
# table (configs, flags and the KV wire layout use the names; engine/dtypes.py
# maps them to torch dtypes, keeping this module importable without torch).
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
DTYPES = tuple(DTYPE_SIZES)
DTYPE_CHOICES = ("auto", *DTYPES)  # what a user may ask for
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
# "compressed-tensors": insist on such a checkpoint (FP8/INT8 weights with
# scales, or pack-quantized 4/8-bit integers); "fp8":
# such a checkpoint, or quantize a float one's linear layers at load.
QUANTIZATIONS = ("gptq", "awq", "compressed-tensors", "fp8")
# --- KV cache dtype (issue 16) ---
# How the paged KV cache stores keys and values: "auto" in the model's dtype;
# "fp8" (= "fp8_e4m3") or "fp8_e5m2" in 8 bits, each value divided by a
# per-tensor scale (engine/kv_quant.py). Bytes per element of every name a
# cache may be stored in, model dtypes included (the KV wire layout uses them).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_DTYPE_SIZES = {**DTYPE_SIZES, "fp8_e4m3": 1, "fp8_e5m2": 1}


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The name the cache is stored in: ``dtype`` (the model's, resolved) for
    "auto", "fp8_e4m3" for "fp8", else ``kv_cache_dtype`` itself."""
    if kv_cache_dtype == "auto":
        return dtype
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
# --- end KV cache dtype ---
_REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family decoder, read from a HF config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # GPTQ/AWQ/pack-quantized weight-only integers (QuantConfig), or 8-bit
    # compressed-tensors weights with scales, of the decoder's linear layers.
    quantization: QuantConfig | CompressedConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"Tandem supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                        "mistral": "MistralForCausalLM"}.get(cfg.get("model_type"), "?")
        # NOTE: checked before any field is read: another family's config
        # (GPT-2's n_embd, n_head) would fail with a KeyError instead.
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; "
                f"Tandem supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        missing = [k for k in _REQUIRED_KEYS if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # transformers 5 writes rope settings as rope_parameters; older files use rope_scaling.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        qkv_bias = bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM"))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            rope_scaling=dict(rope) if rope else None,
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quantization=quant_config_from_dict(quant)
            if (quant := cfg.get("quantization_config")) else None,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} holds no config.json: not a supported model directory")
        return cls.from_dict(json.loads(path.read_text()))

    def check_prompt(self, token_ids: list[int]) -> None:
        """ValueError for an empty prompt or an id outside the vocabulary."""
        if not token_ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )

    @property
    def max_model_len(self) -> int:
        """The longest context the model may be run at. Sliding-window
        attention is not implemented, so a window caps the context."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    ``kv_cache_bytes`` sizes the cache on the CPU; on a GPU the cache takes
    ``gpu_memory_utilization`` of the device memory minus what the weights
    use. ``num_blocks`` overrides both (tests use it to force preemption).
    """

    block_size: int = 16
    kv_cache_bytes: int = 2 << 30
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    # "auto": the model's dtype; "fp8"/"fp8_e4m3"/"fp8_e5m2": 8-bit KV, twice
    # the blocks for the same bytes (KV_CACHE_DTYPES above).
    kv_cache_dtype: str = "auto"
    # GiB of host memory that keeps prefix-cache blocks evicted from the
    # cache, to copy back on a later hit instead of recomputing them
    # (engine/host_kv_tier.py). 0: none. Needs prefix caching.
    host_kv_cache_gib: float = 0.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 256:
            raise ValueError(f"block_size must be in [1, 256], got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.host_kv_cache_gib < 0:
            raise ValueError(f"host_kv_cache_gib must be >= 0, got {self.host_kv_cache_gib}")
        if self.host_kv_cache_gib and not self.enable_prefix_caching:
            raise ValueError("host_kv_cache_gib keeps prefix-cache blocks: it needs "
                             "enable_prefix_caching")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # None: the model's own limit.
    max_model_len: int | None = None
    # The most completions one request may ask for (``n``).
    max_n: int = 16
    # A prompt longer than this is computed at most this many tokens a step,
    # so that requests queued behind it start meanwhile instead of waiting
    # for the whole prompt. None: a prompt may take the step's whole budget.
    long_prefill_token_threshold: int | None = 512

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_n",
                     "long_prefill_token_threshold"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    # "auto": bfloat16 where the hardware computes it natively (CUDA GPUs with
    # bf16, CPUs with AVX512-BF16 or AMX), else float16 on CUDA and float32 on
    # the CPU; resolved once when the engine starts (engine/dtypes.py).
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    attention_backend: str = "auto"
    # "auto": weights from the checkpoint; "dummy": random weights from config.json
    # alone (benchmarks of model shapes that are not on disk).
    load_format: str = "auto"
    # False: on CUDA with a graph-safe attention backend, decode steps replay
    # CUDA graphs (engine/cuda_graphs.py). True: every step runs eagerly.
    enforce_eager: bool = False
    # Ranks the model is split across (attention heads, MLP columns); rank 0
    # runs in this process, the others in spawned ones (one GPU each on CUDA).
    tensor_parallel_size: int = 1
    # --- several nodes: a tensor-parallel group larger than one machine ---
    # The ranks are spread over ``nnodes`` hosts, tensor_parallel_size / nnodes
    # on each (one GPU each). Node 0, the leader, runs the engine and ranks
    # 0..n-1; node k runs only the model shards of ranks k*n..k*n+n-1, which
    # take part in every step (engine/parallel/remote.py, node.py).
    nnodes: int = 1
    node_rank: int = 0
    # Where the leader listens for the other nodes' ranks and they reach it
    # (an address or name of the leader's host). Needed with nnodes > 1;
    # None: 127.0.0.1, one node.
    master_addr: str | None = None
    master_port: int = 29500
    # Seconds the leader waits for every other node's ranks to join, and a
    # node's ranks for the leader to answer: a start that cannot complete
    # fails within this bound instead of waiting forever.
    tp_join_timeout: float = 600.0
    # None: as the checkpoint's quantization_config says. "gptq" / "awq":
    # the same, but a checkpoint quantized otherwise (or not at all) is refused.
    quantization: str | None = None
    # GB (10**9 bytes) of weights kept in pinned host memory and streamed to
    # the accelerator for each forward (engine/weight_offload.py). 0: none.
    # Refused on the CPU device, where there is no separate device memory.
    cpu_offload_gb: float = 0.0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # None: no speculative decoding. A dict is read as SpeculativeConfig.from_dict.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.from_dict(self.speculative_config))
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(
                f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), "
                f"got {self.quantization!r}"
            )
        if self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb must be >= 0, got {self.cpu_offload_gb}")
        if self.cpu_offload_gb > 0 and not self.device.startswith("cuda"):
            raise ValueError(
                f"cpu_offload_gb only means something with an accelerator: on the "
                f"{self.device!r} device the weights are in host memory already; leave it at 0"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        self._check_nodes()
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be 'auto', 'torch' or 'triton', "
                f"got {self.attention_backend!r}"
            )

    def _check_nodes(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be at least 1, got {self.nnodes}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of "
                f"nnodes {self.nnodes}: each node runs tensor_parallel_size / nnodes ranks"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), "
                             f"got {self.node_rank}")
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError("nnodes > 1 needs master_addr: the leader's (node rank 0) "
                             "address, the same on every node")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if not self.tp_join_timeout > 0:
            raise ValueError(f"tp_join_timeout must be positive, got {self.tp_join_timeout}")

    @property
    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks on each node (one GPU each on CUDA)."""
        return self.tensor_parallel_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The tensor-parallel ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of the config dataclass ``cls``.

    The dataclasses are where defaults are said; command-line flags and
    keyword arguments take theirs from here so that they cannot drift apart.
    """
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            raise ValueError(f"{cls.__name__}.{name} has no default")
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


def engine_config_from_flat(model: str | None, **kwargs: Any) -> EngineConfig:
    """An EngineConfig from flat keyword arguments, each the name of a field of
    EngineConfig, CacheConfig or SchedulerConfig (the names do not overlap)."""
    nested: dict[str, Any] = {}
    for name, cls in (("cache", CacheConfig), ("scheduler", SchedulerConfig)):
        mine = {f.name for f in fields(cls)}
        nested[name] = cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in mine})
    return EngineConfig(model=model, **kwargs, **nested)  # type: ignore[arg-type]
