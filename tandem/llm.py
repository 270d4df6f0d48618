"""The offline API: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import inspect
import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_of,
    engine_config_from_flat,
)
from engine.generation_config import check_choice, sampling_defaults
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.prompts import Prompt
from engine.sampling_params import SamplingParams
from engine.tokenizer import ChatOptions, content_text
from gateway.tools import template_call

# vLLM's keywords that change nothing here, with the values whose meaning
# Tandem serves as vLLM would (None: any value): code written for vLLM runs.
# Preemption recomputes (no swap space), prompts are always chunked, the
# model's directory holds its tokenizer, one process group runs it.
_VLLM_NO_OPS: dict[str, tuple | None] = {
    "swap_space": None, "max_seq_len_to_capture": None, "compilation_config": None,
    "disable_custom_all_reduce": None, "enable_chunked_prefill": (None, True),
    "tokenizer_mode": ("auto",), "revision": (None,), "tokenizer_revision": (None,),
    "download_dir": (None,), "distributed_executor_backend": (None, "mp"),
    "pipeline_parallel_size": (1,), "enable_lora": (False,), "skip_tokenizer_init": (False,),
    "task": ("auto", "generate"), "hf_overrides": (None,),
}

# vLLM's other names for dtypes.
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


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
    seed: int | None = default_of(EngineConfig, "seed"),
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
    config dataclasses'). ``dtype`` may be a ``torch.dtype`` or vLLM's
    ``half`` / ``float``; ``seed=None`` picks one at random."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
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

    def __init__(self, model: str | None = None, *, max_logprobs: int = 20,
                 tokenizer: str | None = None, trust_remote_code: bool = False,
                 disable_log_stats: bool = True, generation_config: str = "auto",
                 **kwargs: Any) -> None:
        """``kwargs``: ``engine_config``'s. ``max_logprobs``: the most
        ``logprobs`` / ``prompt_logprobs`` a request may ask for (at most 20).
        ``generation_config``: "auto" samples by the model's
        generation_config.json when no sampling params are given (vLLM's
        default), "vllm" by SamplingParams' own defaults.
        vLLM's ``trust_remote_code`` and ``disable_log_stats`` change nothing
        here (Tandem runs no code from a checkpoint and logs no stats), and
        ``tokenizer`` may only name the model: its directory holds the
        tokenizer."""
        if tokenizer is not None and tokenizer != model:
            raise ValueError("a tokenizer apart from the model is not supported: the model's "
                             "directory must hold its tokenizer.json")
        for name in set(kwargs) & set(_VLLM_NO_OPS):
            value, served = kwargs.pop(name), _VLLM_NO_OPS[name]
            if served is not None and value not in served:
                raise ValueError(f"{name}={value!r} is not supported; Tandem serves "
                                 f"{' or '.join(map(repr, served))}")
        unknown = sorted(set(kwargs) - set(inspect.signature(engine_config).parameters))
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(unknown)}")
        if not isinstance(max_logprobs, int) or not 0 <= max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be in [0, 20], got {max_logprobs!r}")
        self.max_logprobs = max_logprobs
        check_choice(generation_config)  # before the model loads
        self.engine = LLMEngine(engine_config(model, **kwargs))
        self._defaults = sampling_defaults(self.engine.model_dir, generation_config)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no params:
        SamplingParams' defaults, with the model's generation_config.json
        over them (unless ``generation_config="vllm"``)."""
        return SamplingParams(**self._defaults)

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
        lora_request: None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in input order. The prompts are
        queued all or none: a ValueError leaves nothing queued. ``lora_request`` and ``priority``
        are vLLM's; Tandem has neither adapters nor priorities, so they must
        be None (or all priorities equal)."""
        if lora_request is not None:
            raise ValueError("LoRA adapters are not supported")
        if isinstance(prompts, str | Mapping) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if priority is not None and len(set(priority)) > 1:
            raise ValueError("request priorities are not supported")
        # Tokenized once here: queued as ids.
        return self._generate([self.engine.tokenize(p) for p in prompts], sampling_params,
                              use_tqdm)

    def _generate(self, tokenized: list[tuple[str | None, list[int]]],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  use_tqdm: bool) -> list[RequestOutput]:
        """``generate`` of prompts already tokenized: (text or None, ids) each."""
        if not tokenized:
            return []
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(tokenized)
        else:
            params = list(sampling_params)
            if len(params) != len(tokenized):
                raise ValueError(
                    f"got {len(params)} sampling params for {len(tokenized)} prompts"
                )
        engine = self.engine
        ids = [f"llm-{next(self._ids)}" for _ in tokenized]
        # All the prompts or none: add_request validates each (nothing is
        # computed before _run), and one refused takes back those before it.
        for k, (request_id, (text, token_ids), p) in enumerate(zip(ids, tokenized, params)):
            try:
                for name in ("logprobs", "prompt_logprobs"):
                    if (getattr(p, name, None) or 0) > self.max_logprobs:
                        raise ValueError(f"{name} must be at most max_logprobs="
                                         f"{self.max_logprobs}, got {getattr(p, name)}")
                engine.add_request(request_id, token_ids, p, prompt_text=text)
            except BaseException:
                engine.abort_request(ids[:k])
                raise
        outputs = self._run(ids, use_tqdm)
        self._decode_logprobs(outputs)
        return outputs

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (or ``chat_template``) to one
        conversation or a list of them, as vLLM's ``LLM.chat`` (its
        parameters, in its order): a message's content may be a list of
        text parts; ``tools`` and ``chat_template_kwargs`` go to the template;
        ``continue_final_message`` leaves the last message open for the model
        to go on with. Tandem serves text alone: ``lora_request`` and
        ``mm_processor_kwargs`` must be None, and contents are always given
        to the template as strings (``chat_template_content_format`` "auto"
        or "string")."""
        if lora_request is not None:
            raise ValueError("LoRA adapters are not supported")
        if mm_processor_kwargs:
            raise ValueError("multimodal inputs are not supported")
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format {chat_template_content_format!r} "
                             "is not supported; contents are given as strings ('string')")
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer")
        options = ChatOptions.of(add_generation_prompt, continue_final_message,
                                 chat_template_kwargs)
        variables = options.variables_with(tools)
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        texts = [tokenizer.apply_chat_template(
            [_text_message(i, m) for i, m in enumerate(c)], options.add_generation_prompt,
            template=chat_template, continue_final_message=options.continue_final_message,
            **variables)
            for c in conversations]  # type: ignore[arg-type]
        # NOTE: as vLLM, each output's prompt is the rendered text; the template
        # writes the special tokens itself.
        return self._generate([(text, tokenizer.encode(text, add_special_tokens=False))
                               for text in texts], sampling_params, use_tqdm)

    def _decode_logprobs(self, outputs: list[RequestOutput]) -> None:
        """Each Logprob's ``decoded_token``: its token's text, as vLLM gives it."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return
        entries = [e for out in outputs for e in (out.prompt_logprobs or []) if e]
        entries += [e for out in outputs for c in out.outputs for e in (c.logprobs or [])]
        texts: dict[int, str] = {}  # the same ids come up at many positions
        for entry in entries:
            for token_id, logprob in entry.items():
                if logprob.decoded_token is None:
                    if token_id not in texts:
                        texts[token_id] = tokenizer.decode([token_id], False)
                    logprob.decoded_token = texts[token_id]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)  # this call's own: another caller may have queued more
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        try:
            while len(done) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            # NOTE: a step cut short (an error, a Ctrl-C in the forward pass)
            # published blocks to the prefix cache that it never wrote: as the
            # async engine does, abort what it touched and forget the cache,
            # or the next prompts read that garbage as their prefix.
            self.engine.recover_from_failed_step()
            self.engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _text_message(index: int, message: Any) -> Any:
    """``message`` as chat templates take it: a content of OpenAI text parts
    joined into a string, no content (None, or none given) as "", and the
    tool calls' arguments as objects."""
    if not isinstance(message, Mapping):
        return message
    out = dict(message)
    try:
        content = message.get("content")
        if isinstance(content, list) or content is None:
            out["content"] = content_text(content)
        if message.get("tool_calls"):
            out["tool_calls"] = [template_call(c) for c in message["tool_calls"]]
    except ValueError as exc:
        raise ValueError(f"messages[{index}]: {exc}") from None
    return out
