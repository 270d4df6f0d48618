"""The synchronous engine: add requests, call ``step`` until done.

One step = schedule, run the model on the flattened batch, sample, update
progress, detokenize. The offline ``LLM``, the ``AsyncEngine`` and both
workers drive this class.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache_manager import KVCacheManager
from engine.loader.resolve import resolve_model_dir
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer

logger = logging.getLogger("engine")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model_dir(config.model,
                                           allow_no_weights=config.load_format == "dummy")
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self._check_quantization()
        has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer(self.model_dir) if has_tokenizer else None
        self.eos_token_ids = self._eos_token_ids()
        self.max_model_len = self._max_model_len()
        self.runner = ModelRunner(config, self.model_config, self.model_dir, self.max_model_len)
        cache = config.cache
        self.kv = KVCacheManager(self.runner.num_blocks, cache.block_size,
                                 cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer)
        logger.info(
            "KV cache: %d blocks = %d tokens (block_size %d, %.1f MiB); max_model_len %d",
            self.runner.num_blocks, self.runner.num_blocks * cache.block_size,
            cache.block_size, self.runner.num_blocks * self.runner.block_bytes / 2**20,
            self.max_model_len,
        )

    # ---- requests ------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request. Raises ValueError before anything is
        allocated if the request cannot be served."""
        params = params or SamplingParams()
        prompt_text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        sequences = self.make_sequences(request_id, token_ids, params, arrival_time)
        self.outputs.add(request_id, prompt_text, sequences)
        self.scheduler.add_request(sequences[0])

    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, Sequence):  # e.g. LLM.generate([1.5]): a TypeError otherwise
            raise ValueError(
                f"a prompt must be a string or a list of integer token ids, "
                f"got {type(prompt).__name__}"
            )
        token_ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise ValueError("prompt token ids must be integers")
        return None, token_ids

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self.model_config.check_prompt(token_ids)
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        if params.n > self.config.scheduler.max_n:
            raise ValueError(f"n must be at most {self.config.scheduler.max_n}, got {params.n}")
        needed = self.kv.num_blocks_for(total)
        if needed > self.runner.num_blocks:
            raise ValueError(
                f"the request needs {needed} KV blocks, the cache has {self.runner.num_blocks}"
            )

    def make_sequences(self, request_id: str, token_ids: list[int], params: SamplingParams,
                       arrival_time: float | None = None) -> list[Request]:
        if request_id in self.outputs.groups or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        now = arrival_time if arrival_time is not None else time.monotonic()
        ids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.n)]
        seqs = [
            Request(seq_id, token_ids, params, self.eos_token_ids, now, index=i,
                    parent_id=request_id if i else None)
            for i, seq_id in enumerate(ids)
        ]
        seqs[0].pending_children = seqs[1:]
        return seqs

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Finish requests at once and free their blocks. Unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outs = []
        for request_id in request_ids:
            for seq in self.outputs.sequences(request_id):
                self.scheduler.finish(seq.request_id, RequestStatus.FINISHED_ABORTED)
                self.runner.remove_request(seq.request_id)
            out = self.outputs.abort(request_id)
            if out is not None:
                outs.append(out)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step --------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched:
            return []
        result = self.runner.execute(sched)
        for request_id, lp in result.logprobs.items():
            self.scheduler.requests[request_id].logprobs.append(lp)
        changed = self.scheduler.update(sched, result.sampled)
        outputs, stopped = self.outputs.process(changed)
        for seq_id in stopped:
            self.scheduler.finish(seq_id, RequestStatus.FINISHED_STOPPED)
        for seq in changed:
            if seq.finished:
                self.runner.remove_request(seq.request_id)
        return outputs

    def shutdown(self) -> None:
        """Stop the tensor-parallel follower processes, if any. Idempotent."""
        self.runner.shutdown()

    def on_unusable(self, callback: Callable[[], None]) -> None:
        """``callback()`` (from any thread) once the engine can no longer
        step: its tensor-parallel group broke (EngineUnusable)."""
        self.runner.tp.on_broken.append(callback)

    # ---- config ------------------------------------------------------------------

    def _check_quantization(self) -> None:
        asked = self.config.quantization
        found = self.model_config.quantization
        if asked is not None and (found is None or found.method != asked):
            have = f"{found.method}-quantized" if found else "not quantized"
            raise ValueError(f"quantization={asked!r} was asked for, but {self.model_dir} is "
                             f"{have}")

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def _max_model_len(self) -> int:
        model_max = self.model_config.max_model_len
        asked = self.config.scheduler.max_model_len
        if asked is None:
            return model_max
        if asked > model_max:
            raise ValueError(f"max_model_len {asked} exceeds the model's limit of {model_max}")
        return asked
