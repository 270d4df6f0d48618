"""The offline API: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from engine.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_of,
    engine_config_from_flat,
)
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


def engine_config(
    model: str | None = None,
    *,
    dtype: str = default_of(EngineConfig, "dtype"),
    device: str = default_of(EngineConfig, "device"),
    block_size: int = default_of(CacheConfig, "block_size"),
    max_model_len: int | None = default_of(SchedulerConfig, "max_model_len"),
    max_num_seqs: int = default_of(SchedulerConfig, "max_num_seqs"),
    max_num_batched_tokens: int = default_of(SchedulerConfig, "max_num_batched_tokens"),
    enable_prefix_caching: bool = default_of(CacheConfig, "enable_prefix_caching"),
    seed: int = default_of(EngineConfig, "seed"),
    kv_cache_bytes: int = default_of(CacheConfig, "kv_cache_bytes"),
    gpu_memory_utilization: float = default_of(CacheConfig, "gpu_memory_utilization"),
    num_blocks: int | None = default_of(CacheConfig, "num_blocks"),
    attention_backend: str = default_of(EngineConfig, "attention_backend"),
    load_format: str = default_of(EngineConfig, "load_format"),
    enforce_eager: bool = default_of(EngineConfig, "enforce_eager"),
    tensor_parallel_size: int = default_of(EngineConfig, "tensor_parallel_size"),
    quantization: str | None = default_of(EngineConfig, "quantization"),
    nnodes: int = default_of(EngineConfig, "nnodes"),
    node_rank: int = default_of(EngineConfig, "node_rank"),
    master_addr: str | None = default_of(EngineConfig, "master_addr"),
    master_port: int = default_of(EngineConfig, "master_port"),
    tp_join_timeout: float = default_of(EngineConfig, "tp_join_timeout"),
    kv_cache_dtype: str = default_of(CacheConfig, "kv_cache_dtype"),
    host_kv_cache_gib: float = default_of(CacheConfig, "host_kv_cache_gib"),
    cpu_offload_gb: float = default_of(EngineConfig, "cpu_offload_gb"),
    max_n: int = default_of(SchedulerConfig, "max_n"),
    long_prefill_token_threshold: int | None = default_of(SchedulerConfig,
                                                          "long_prefill_token_threshold"),
    # NOTE: None, EngineConfig's default, spelled out: ruff's B008 refuses a
    # call in the default of a field that is not of an immutable type.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
) -> EngineConfig:
    """Build an EngineConfig from vLLM-style keyword arguments (defaults: the
    config dataclasses')."""
    return engine_config_from_flat(
        model, dtype=dtype, device=device, seed=seed, attention_backend=attention_backend,
        load_format=load_format, enforce_eager=enforce_eager,
        tensor_parallel_size=tensor_parallel_size, quantization=quantization,
        nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port,
        tp_join_timeout=tp_join_timeout,
        kv_cache_dtype=kv_cache_dtype, cpu_offload_gb=cpu_offload_gb,
        host_kv_cache_gib=host_kv_cache_gib,
        block_size=block_size, kv_cache_bytes=kv_cache_bytes,
        gpu_memory_utilization=gpu_memory_utilization, num_blocks=num_blocks,
        enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, max_n=max_n,
        long_prefill_token_threshold=long_prefill_token_threshold,
        speculative_config=speculative_config,
    )


class LLM:
    """An engine in this process, for batch generation.

    ``model`` is a directory (config.json + safetensors) or a ``.gguf`` file;
    by default the bundled SmolLM2-135M-Instruct.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(engine_config(model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's ``LLM.reset_prefix_cache``):
        the next prompts are computed in full. True once done."""
        self.engine.reset_prefix_cache()
        return True

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in input order. Every prompt is
        validated before any is queued."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if not prompts:
            raise ValueError("prompts must not be empty")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} sampling params for {len(prompts)} prompts"
                )
        engine = self.engine
        for prompt, p in zip(prompts, params):
            engine.validate(engine.tokenize(prompt)[1], p)
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params):
            engine.add_request(request_id, prompt, p)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [tokenizer.encode_chat(c, add_generation_prompt)
                   for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        try:
            while len(done) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]
