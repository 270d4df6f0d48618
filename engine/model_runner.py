"""Rank 0's model runner: applies each SchedulerOutput to its persistent
batch, builds one flattened, unpadded step from it, runs it (on every
tensor-parallel rank), and samples."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.batch import CachedRequestState, InputBatch
from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.device import claim_device, comm_backend, on_device, rank_device
from engine.errors import EngineUnusable
from engine.kv_blocks import KVBlockView
from engine.model_shard import ModelShard
from engine.parallel import TensorParallel
from engine.parallel.followers import Followers
from engine.parallel.sharded_kv import ShardedKVBlocks
from engine.sampler import SamplingBatch, logprob_entries, sample
from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.spec_decode.verify import VerifyRows, verify
from engine.structured_output.matchers import GrammarMatchers

logger = logging.getLogger("engine")


@dataclass
class PromptRows:
    """Rows ``[row_lo, row_hi)`` of a step score prompt tokens ``first + 1``
    .. ``last`` of ``request`` (prompt_logprobs)."""

    request: CachedRequestState
    first: int
    last: int
    row_lo: int
    row_hi: int


class ModelRunner:
    """Rank 0's side of the model: runs each step on its shard (and, with
    tensor parallelism, has the follower ranks run it on theirs), then
    computes logits and samples."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model_dir: Path,
                 max_model_len: int) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tp = TensorParallel(0, config.tensor_parallel_size)
        shard_config = dataclasses.replace(config, device=rank_device(config.device, 0))
        self.shard = ModelShard(shard_config, model_cfg, model_dir, max_model_len, self.tp)
        self._threads = torch.get_num_threads()  # restored by shutdown()
        claim_device(shard_config.device, config.ranks_per_node)
        logger.info("attention backend: %s on %s; tensor parallel: %d",
                    self.backend.name, self.device, self.tp.size)
        self.num_blocks = self._num_blocks()
        self.shard.allocate_cache(self.num_blocks)
        # Whole blocks of the cache, all ranks' heads: what KV transfer moves.
        self.kv_blocks: KVBlockView = self.shard.blocks
        self.followers: Followers | None = None
        if self.tp.size > 1:
            address = self.tp.host(config.master_addr)  # None: 127.0.0.1, one node
            self.followers = Followers(shard_config, model_cfg, model_dir, max_model_len,
                                       self.num_blocks, self.tp, address)
            try:
                self.followers.wait_ready()
                self.tp.join(address, comm_backend(config.device))
            except BaseException:
                self.followers.kill()
                torch.set_num_threads(self._threads)
                raise
            self.kv_blocks = ShardedKVBlocks(self.shard.blocks, self.tp, self.followers.send)
        self.input_batch = InputBatch(config.scheduler.max_num_seqs, max_model_len,
                                      self.block_size)
        self.decode_graphs = self._decode_graphs(max_model_len)
        tokenizer = model_dir / "tokenizer.json"
        self.grammars = GrammarMatchers(tokenizer if tokenizer.is_file() else None,
                                        model_cfg.vocab_size)

    def _decode_graphs(self, max_model_len: int) -> DecodeGraphs | None:
        # NOTE: with tensor parallelism every rank would have to record and
        # replay its own graphs in step; not done yet, so those steps run eagerly.
        # Nor with cpu_offload_gb: a graph would replay reads of freed weight copies.
        use = (self.device.type == "cuda" and self.backend.graph_safe
               and not self.config.enforce_eager and self.tp.size == 1
               and not self.config.cpu_offload_gb)
        logger.info("decode steps: %s", "CUDA graphs" if use else "eager")
        if not use:
            return None
        return DecodeGraphs(
            self.model, self.kv_caches, max_batch=self.config.scheduler.max_num_seqs,
            max_model_len=max_model_len, block_size=self.block_size, device=self.device,
        )

    # What rank 0's shard holds, under the names the engine and tests use.
    @property
    def model(self):
        return self.shard.model

    @property
    def backend(self):
        return self.shard.backend

    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def block_size(self) -> int:
        return self.shard.block_size

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.shard.kv_caches

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V for one block across all layers (on each rank)."""
        return self.shard.block_bytes

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

    def shutdown(self) -> None:
        """Stop the follower ranks and leave the group. Idempotent."""
        self.grammars.shutdown()
        followers, self.followers = self.followers, None
        if followers is None:
            return
        try:
            with self.tp.command():
                followers.send(None)
        except EngineUnusable as exc:  # one is gone already: stop the others below
            logger.warning("tensor-parallel shutdown: %s", exc)
        finally:
            if self.tp.broken is not None:
                followers.kill()  # they may wait in a collective that never completes
            else:
                followers.stop()
            self.tp.leave()
            torch.set_num_threads(self._threads)

    @property
    def num_requests(self) -> int:
        """Requests the runner holds state for (until a step says they are gone)."""
        return len(self.input_batch)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        # Steps run on the engine's own thread: make this rank's GPU current there.
        with on_device(self.device), torch.inference_mode():
            return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.input_batch.update(out)
        self.grammars.update(out)
        result = ModelRunnerOutput()
        if not out.scheduled:
            return result
        batch, rows = self.input_batch.prepare(out)
        sampling = [state for state, _ in rows.sampled]
        prompts = [p for p in (self._plan_prompt_logprobs(*r, result) for r in rows.prompt_rows)
                   if p]
        # The rows that need logits, one call per group: the sampled rows,
        # then each prompt chunk's (so a [rows, vocab] matrix is never larger
        # than one chunk's). With tensor parallelism each call is a gather the
        # followers join, so they get the same list.
        # NOTE: speculative decoding's rows (every row of each proposal) join
        # the sampled rows' call: on the CPU one LM-head matmul over 20 rows
        # costs about what one over 16 does, a second call as much again.
        spec_rows = [r for _, lo, draft in rows.spec for r in range(lo, lo + len(draft) + 1)]
        calls = [[row for _, row in rows.sampled] + spec_rows] if sampling or spec_rows else []
        calls += [list(range(p.row_lo, p.row_hi)) for p in prompts]
        # Grammar masks of constrained rows, computed while the forward runs.
        masks = self.grammars.start([state.request_id for state in sampling])
        if self.followers is not None:
            with self.tp.command():  # the followers run the same forward and logits
                self.followers.send(("forward", batch, calls))
                hidden = self.shard.forward(batch)
                logits = [self.model.compute_logits(hidden[c]) for c in calls]
        else:
            input_ids, positions, meta = batch.to_device(self.device)
            if self.decode_graphs is not None and self.decode_graphs.fits(meta):
                hidden = self.decode_graphs.run(input_ids, positions, meta)
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
            logits = [self.model.compute_logits(hidden[c]) for c in calls]

        row_logits = logits.pop(0) if sampling or spec_rows else None
        if spec_rows:
            self._verify(rows.spec, row_logits[len(sampling):], result)
        if sampling:
            batch_params = SamplingBatch.prepare(
                sampling, [self._generator(r) for r in sampling],
                self.model_cfg.vocab_size, self.device,
            )
            banned, dead_rows = self.grammars.banned(masks)
            batch_params.banned = None if banned is None else banned.to(self.device)
            sampled = sample(row_logits[: len(sampling)], batch_params)
            for row, (state, token, lp) in enumerate(
                    zip(sampling, sampled.token_ids, sampled.logprobs)):
                # Its grammar allows no token (or not the one sampled, which only
                # min_tokens' EOS ban can force): no token, it ends.
                if row in dead_rows or not self.grammars.accept(state.request_id, token):
                    result.grammar_dead_ends.append(state.request_id)
                    continue
                state.token_ids.append(token)
                result.sampled[state.request_id] = token
                if lp is not None:
                    result.logprobs[state.request_id] = lp
        for p, chunk_logits in zip(prompts, logits, strict=True):
            self._fill_prompt_logprobs(p, chunk_logits, result)
        return result

    def _verify(self, spec: list[tuple[CachedRequestState, int, list[int]]],
                logits: torch.Tensor, result: ModelRunnerOutput) -> None:
        """Speculative decoding: keep what the target agrees with. A
        constrained request's draft is cut to what its grammar allows and its
        rows masked, so the tokens kept are the grammar's too."""
        seqs, at, kept = [], 0, []
        for state, _, draft in spec:
            rows = len(draft) + 1
            if state.request_id in self.grammars:
                draft, banned = self.grammars.draft_masks(state.request_id, draft)
                if bool(banned[0].all()):  # the grammar allows no token at all
                    result.grammar_dead_ends.append(state.request_id)
                    at += rows
                    continue
                logits[at : at + len(draft) + 1].masked_fill_(banned.to(logits.device),
                                                              float("-inf"))
            seqs.append(VerifyRows(state, draft, None, self._generator(state), at))
            kept.append(state)
            at += rows
        for state, tokens in zip(kept, verify(logits, seqs, self.model_cfg.vocab_size)):
            for token in tokens:
                self.grammars.accept(state.request_id, token)
            state.token_ids.extend(tokens)
            result.spec_tokens[state.request_id] = tokens

    def _generator(self, state: CachedRequestState) -> torch.Generator | None:
        seed = state.params.seed
        if seed is None:
            return None
        if state.generator is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)  # completion i of n has seed + i already (completions.py)
            # Tokens sampled elsewhere (a prefill worker's first token, the
            # tokens of a migrated request) each used one draw: skip them, so
            # the seed gives the same tokens wherever they are sampled.
            for _ in range(state.num_output_tokens):
                torch.empty(self.model_cfg.vocab_size, device=self.device).exponential_(
                    generator=gen
                )
            state.generator = gen
        return state.generator

    def _plan_prompt_logprobs(self, state: CachedRequestState, start: int, begin: int,
                              end: int, result: ModelRunnerOutput) -> PromptRows | None:
        """Which rows of this step's chunk ``[begin, end)`` (positions
        ``start``..) score prompt tokens that have no logprob yet."""
        if state.num_prompt_logprobs == 0:  # the first token has none
            result.prompt_logprobs[state.request_id] = [None]
            state.num_prompt_logprobs = 1
        last = min(start + end - begin, state.num_prompt_tokens - 1)
        if state.num_prompt_logprobs > last:  # recomputing after a preemption
            return None
        first = state.num_prompt_logprobs - 1  # first position still missing
        return PromptRows(state, first, last, begin + first - start, begin + last - start)

    def _fill_prompt_logprobs(self, p: PromptRows, logits: torch.Tensor,
                              result: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens first+1 .. last, predicted by positions first.. ."""
        state = p.request
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(state.token_ids[p.first + 1 : p.last + 1], device=self.device)
        n = state.params.prompt_logprobs or 0
        entries = logprob_entries(logprobs, targets, [n] * len(targets))
        state.num_prompt_logprobs = p.last + 1
        result.prompt_logprobs.setdefault(state.request_id, []).extend(entries)
