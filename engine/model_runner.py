"""Owns the model and the KV cache tensors; turns a SchedulerOutput into one
flattened, unpadded batch, runs it, and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.attention import AttentionMetadata, get_attention_backend
from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.loader.weights import iterate_weights
from engine.models import build_model
from engine.request import Request
from engine.sampler import SamplingBatch, sample
from engine.scheduler_output import SchedulerOutput

logger = logging.getLogger("engine")


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model_dir: Path,
                 max_model_len: int) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.block_size = config.cache.block_size
        self.backend = get_attention_backend(config.attention_backend, config.device)
        logger.info("attention backend: %s on %s", self.backend.name, self.device)
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        try:
            torch.set_default_dtype(self.dtype)
            with torch.device(self.device):
                self.model = build_model(model_cfg, self.backend, max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            self._init_dummy_weights()
        else:
            self.model.load_weights(iterate_weights(model_dir))
        self.model.eval()
        self.num_blocks = self._num_blocks()
        shape = (self.num_blocks, self.block_size, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(model_cfg.num_layers)
        ]
        self.generators: dict[str, torch.Generator] = {}
        self.decode_graphs = self._decode_graphs(max_model_len)

    def _decode_graphs(self, max_model_len: int) -> DecodeGraphs | None:
        use = (self.device.type == "cuda" and self.backend.graph_safe
               and not self.config.enforce_eager)
        logger.info("decode steps: %s", "CUDA graphs" if use else "eager")
        if not use:
            return None
        return DecodeGraphs(
            self.model, self.kv_caches, max_batch=self.config.scheduler.max_num_seqs,
            max_model_len=max_model_len, block_size=self.block_size, device=self.device,
        )

    @torch.no_grad()
    def _init_dummy_weights(self) -> None:
        gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
        for name, param in self.model.named_parameters():
            if not param.is_floating_point():  # quantized layers
                if name.endswith("qweight"):
                    param.random_(generator=gen)  # random integers; g_idx keeps its order
                continue
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V for one block across all layers."""
        cfg = self.model_cfg
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cache.gpu_memory_utilization) - (total - free)
        else:
            budget = cache.kv_cache_bytes
        num = budget // self.block_bytes
        if num < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of "
                f"{self.block_bytes} bytes; raise kv_cache_bytes / gpu_memory_utilization"
            )
        return int(num)

    def remove_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, meta, logits_index, prompt_rows = self._prepare(out)
        if self.decode_graphs is not None and self.decode_graphs.fits(meta):
            hidden = self.decode_graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)

        result = RunnerOutput()
        sampling = [s.request for s in out.scheduled if s.sample]
        rows = [logits_index[s.request.request_id] for s in out.scheduled if s.sample]
        if sampling:
            logits = self.model.compute_logits(hidden[rows])
            batch = SamplingBatch.prepare(
                sampling, [self._generator(r) for r in sampling],
                self.model_cfg.vocab_size, self.device,
            )
            sampled = sample(logits, batch)
            for request, token, lp in zip(sampling, sampled.token_ids, sampled.logprobs):
                result.sampled[request.request_id] = token
                if lp is not None:
                    result.logprobs[request.request_id] = lp
        for request, start, begin, end in prompt_rows:
            self._prompt_logprobs(request, start, hidden[begin:end])
        return result

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.params.seed
        if seed is None:
            return None
        gen = self.generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed + request.index)
            # Tokens sampled elsewhere (a prefill worker's first token, the
            # tokens of a migrated request) each used one draw: skip them, so
            # the seed gives the same tokens wherever they are sampled.
            for _ in range(request.num_output_tokens):
                torch.empty(self.model_cfg.vocab_size, device=self.device).exponential_(
                    generator=gen
                )
            self.generators[request.request_id] = gen
        return gen

    def _prepare(self, out: SchedulerOutput):
        bs = self.block_size
        num_seqs = len(out.scheduled)
        num_tokens = out.num_batched_tokens
        ids = np.empty(num_tokens, dtype=np.int64)
        pos = np.empty(num_tokens, dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        query_start = np.zeros(num_seqs + 1, dtype=np.int32)
        seq_lens = np.empty(num_seqs, dtype=np.int32)
        max_blocks = max(len(s.request.block_ids) for s in out.scheduled)
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        logits_index: dict[str, int] = {}
        prompt_rows = []
        t = 0
        for i, s in enumerate(out.scheduled):
            request, start, n = s.request, s.start, s.num_new_tokens
            blocks = request.block_ids
            tables[i, : len(blocks)] = blocks
            if n == 1:  # the decode fast path: plain integers, no array temporaries
                ids[t] = request.token_ids[start]
                pos[t] = start
                slots[t] = blocks[start // bs] * bs + start % bs
            else:
                p = np.arange(start, start + n)
                ids[t : t + n] = request.token_ids[start : start + n]
                pos[t : t + n] = p
                slots[t : t + n] = tables[i, p // bs].astype(np.int64) * bs + p % bs
            # NOTE: only the first of n completions: the others start past the
            # prompt blocks they share with it, so they lack the early rows.
            # max(.., 1): a one-token prompt still gets its [None].
            if (request.params.prompt_logprobs is not None and request.index == 0
                    and start < max(request.num_prompt_tokens - 1, 1)):
                prompt_rows.append((request, start, t, t + n))
            t += n
            query_start[i + 1] = t
            seq_lens[i] = start + n
            if s.sample:
                logits_index[request.request_id] = t - 1

        dev = self.device
        qsl_cpu = torch.from_numpy(query_start)
        lens_cpu = torch.from_numpy(seq_lens)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=qsl_cpu.to(dev),
            seq_lens=lens_cpu.to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=lens_cpu,
            num_decode_seqs=out.num_decodes,
            max_query_len=int(np.diff(query_start).max()),
            max_seq_len=int(seq_lens.max()),
        )
        return (torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev), meta,
                logits_index, prompt_rows)

    def _prompt_logprobs(self, request: Request, start: int, hidden: torch.Tensor) -> None:
        """Logprobs of prompt tokens start+1 .. predicted by positions start.. of this chunk."""
        last = min(start + hidden.shape[0], request.num_prompt_tokens - 1)
        if not request.prompt_logprobs:
            request.prompt_logprobs.append(None)
        if len(request.prompt_logprobs) > last:  # recomputing after a preemption
            return
        first = len(request.prompt_logprobs) - 1  # first position still missing
        rows = hidden[first - start : last - start]
        logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
        targets = torch.tensor(request.token_ids[first + 1 : last + 1], device=self.device)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
        n = request.params.prompt_logprobs or 0
        top_vals, top_ids = logprobs.topk(max(n, 1), dim=-1)
        for j, (token, lp) in enumerate(zip(targets.tolist(), chosen)):
            entry = {token: lp}
            for tid, val in zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist()):
                entry.setdefault(tid, val)
            request.prompt_logprobs.append(entry)
