"""The synchronous engine: add requests, call ``step`` until done.

One step = schedule, run the model on the flattened batch, sample, update
progress, detokenize. The offline ``LLM``, the ``AsyncEngineLoop`` and both
workers drive this class, through its public methods only: they never touch
the scheduler, the KV cache manager or the runner.

What a request's blocks go through, by caller::

    local       add_request -> step ... -> finished: freed
    prefill     add_request(hold_blocks=True) -> step ... -> kv_progress
                (export the blocks) -> release
    decode      reserve_remote (blocks to write into) -> start_remote
                (the KV landed) -> step ... -> finished: freed
    any         abort_request: freed at once, whatever the state

(The prefill and decode rows' own calls are engine/kv_handoff.py's.)
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Sequence

from engine.completions import split_completions
from engine.config import EngineConfig
from engine.host_kv_store import host_tier
from engine.kv_cache_manager import KVCacheManager
from engine.kv_handoff import KVHandoff
from engine.layer_streams import LayerStreams
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import EngineStats, RequestOutput
from engine.prompts import Prompt, bad_word_ids, tokenize, with_max_tokens
from engine.request import Request, RequestStatus
from engine.request_checks import check_request
from engine.resolved import eos_token_ids, resolve_model
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.spec_decode import make_spec_decoder
from engine.tokenizer import Tokenizer

logger = logging.getLogger("engine")


class LLMEngine(KVHandoff):
    def __init__(self, config: EngineConfig) -> None:
        if config.node_rank != 0:
            raise ValueError(
                f"node_rank {config.node_rank} runs only its ranks' model shards, not an "
                "engine: start it with a worker entry point (python -m decode_service "
                "--node-rank ...), which joins the leader's group"
            )
        # "auto" and the like become what runs, once: everything below (and
        # the KV layout workers compare) sees the concrete dtype.
        resolved = resolve_model(config)
        config = self.config = resolved.config
        self.model_dir = resolved.model_dir
        self.model_config = resolved.model_config
        has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer(self.model_dir) if has_tokenizer else None
        self.eos_token_ids = eos_token_ids(resolved, self.tokenizer)
        self.max_model_len = resolved.max_model_len
        self.runner = ModelRunner(config, self.model_config, self.model_dir, self.max_model_len)
        # An engine dropped without shutdown() (``del llm``) still stops its
        # follower ranks and leaves the process group, so the next engine
        # with tensor parallelism in this process can form one.
        weakref.finalize(self, self.runner.shutdown)
        cache = config.cache
        cache_tokens = self.runner.num_blocks * cache.block_size
        if cache_tokens < self.max_model_len:  # a longer sequence could never be held
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len %d: serving "
                           "at most that many", cache_tokens, self.max_model_len)
            self.max_model_len = cache_tokens
        self.kv = KVCacheManager(self.runner.num_blocks, cache.block_size,
                                 cache.enable_prefix_caching)
        self.spec = make_spec_decoder(config, self.model_config, self.max_model_len)
        tier = host_tier(cache.host_kv_cache_gib, self.runner, self.model_config.num_layers,
                         config.tensor_parallel_size)
        if tier is not None:
            self.kv.attach_host_tier(tier)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.spec)
        self.layer_streams = LayerStreams(self.scheduler, self.kv)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.num_steps = 0  # steps that ran the model: a liveness signal for callers
        logger.info(
            "dtype %s; KV cache: %s, %d blocks = %d tokens (block_size %d, %.1f MiB); "
            "max_model_len %d", config.dtype, self.kv_cache_spec.name,
            self.runner.num_blocks, self.runner.num_blocks * cache.block_size,
            cache.block_size, self.runner.num_blocks * self.runner.block_bytes / 2**20,
            self.max_model_len,
        )

    # ---- requests: the only way in ---------------------------------------------
    #
    # Every call below runs on the thread that steps the engine, between two
    # steps. A call that raises ValueError has changed nothing.

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        prompt_text: str | None = None,
        hold_blocks: bool = False,
        output_token_ids: Sequence[int] = (),
    ) -> None:
        """Queue a request whose prompt is computed here.

        ``prompt_text``: the text a token-id ``prompt`` was encoded from, if
        any (outputs carry it). ``hold_blocks``: after the request finishes
        its blocks stay allocated and readable (``kv_progress``) until
        ``release`` or ``abort_request``: a prefill worker exports them.
        ``output_token_ids``: tokens an earlier attempt already generated and
        sent (a migrated request): they are recomputed with the prompt and
        not output again.
        """
        text, token_ids = self.tokenize(prompt)
        params = with_max_tokens(params or SamplingParams(), len(token_ids), self.max_model_len)
        self.validate(token_ids, params)
        if (hold_blocks or output_token_ids) and params.n != 1:
            raise ValueError("a request that holds its blocks or resumes is one sequence (n=1)")
        if output_token_ids and len(output_token_ids) >= params.max_tokens:
            raise ValueError("the request already has max_tokens tokens")
        sequences = self._new_sequences(request_id, token_ids, params, arrival_time)
        first = sequences[0]
        first.hold_blocks = hold_blocks
        first.token_ids.extend(output_token_ids)
        self.output_processor.add(request_id, text if text is not None else prompt_text, sequences)
        if output_token_ids:
            self.output_processor.skip_sent(request_id, len(output_token_ids))
        self.scheduler.add_request(first)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Finish requests at once and free their blocks (also those held or
        reserved). Unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outs = []
        for request_id in request_ids:
            self.layer_streams.drop(request_id)
            for seq in self.output_processor.sequences(request_id):
                self.scheduler.finish(seq.request_id, RequestStatus.FINISHED_ABORTED)
            out = self.output_processor.abort(request_id)
            if out is not None:
                outs.append(out)
        if not self.scheduler.has_unfinished():
            self._forget_if_idle(self.scheduler.schedule())
        return outs

    def recover_from_failed_step(self) -> list[str]:
        """After ``step`` raised: abort every request the step may have
        touched and forget the prefix cache (it published blocks the step
        never wrote). Reservations are kept: they were not in the step, and
        a transfer may be writing their blocks. Returns the aborted ids."""
        remote = self.scheduler.remote
        ids = [rid for rid in self.output_processor.groups
               if not any(s.request_id in remote for s in self.output_processor.sequences(rid))]
        self.abort_request(ids)
        self.reset_prefix_cache()
        return ids

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the host tier's and a draft model's
        too). The prefix-cache counters go on counting: they are totals
        since the engine started, as Prometheus counters must be."""
        self.kv.reset_prefix_cache()
        if self.draft_engine is not None:
            self.draft_engine.reset_prefix_cache()

    @property
    def draft_engine(self) -> LLMEngine | None:
        """The draft model's own engine, with draft-model speculation."""
        return self.spec.proposer.engine if self.spec is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_backlog(self, share: float = 1.0) -> bool:
        """``share`` of a step's budget of work or more is queued (1: the
        next step is a full one, and what it cannot take waits for the one
        after). A prefill worker then asks its neighbours for cores
        (engine/core_lease.py says which share)."""
        return self.scheduler.backlogged(share)

    def awaits_remote_kv(self) -> bool:
        """Blocks are reserved for KV that a prefill worker computes now."""
        return bool(self.scheduler.remote)

    @property
    def reserves_during_forward(self) -> bool:
        """Whether ``reserve_remote`` may run while a forward pass does
        (``AsyncEngineLoop.run_concurrently``): it reads and writes only the
        scheduler's and the block pool's bookkeeping, unless a host KV tier
        is attached. Then a block it evicts is copied out of the cache: on
        a GPU a copy beside the step's kernels, under tensor parallelism a
        collective beside the step's own."""
        return self.kv.host_tier is None

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_requests=len(self.output_processor.groups), num_sequences=len(self.scheduler.requests),
            num_blocks=self.runner.num_blocks,
            num_free_blocks=kv.num_free_blocks, kv_usage=kv.usage,
            prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits,
            num_steps=self.num_steps,
            spec_decode=self.spec.stats.snapshot() if self.spec is not None else None,
            host_tier_restored_blocks=kv.host_tier.blocks_restored if kv.host_tier else 0,
            host_tier_bytes=kv.host_tier.bytes_moved if kv.host_tier else 0,
        )

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def kv_cache_spec(self):
        """What the KV cache is stored in (``engine.kv_quant.KVCacheSpec``)."""
        return self.runner.shard.kv_spec

    def num_blocks_for(self, num_tokens: int) -> int:
        return self.kv.num_blocks_for(num_tokens)

    @property
    def kv_blocks(self):
        """Whole KV blocks (all layers, all ranks' heads) to read and write:
        what KV transfer moves. Use only with ids this engine handed out."""
        return self.runner.kv_blocks

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and token ids (engine/prompts.py)."""
        return tokenize(self.tokenizer, prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """ValueError unless this engine can serve the request: the gateway's
        ``check_request``, against this engine's context (never more than its
        cache holds, so a request that passes fits the cache), and what needs
        its tokenizer."""
        params = with_max_tokens(params, len(token_ids), self.max_model_len)
        check_request(token_ids, params, self.model_config, self.max_model_len,
                      self.config.scheduler.max_n)
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured_outputs need the model's tokenizer (tokenizer.json)")

    def _new_sequences(self, request_id: str, token_ids: list[int], params: SamplingParams,
                       arrival_time: float | None = None) -> list[Request]:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"a request id must be a non-empty string, got {request_id!r}")
        completions = split_completions(request_id, params)
        if request_id in self.output_processor.groups or any(
                seq_id in self.scheduler.requests for seq_id, _ in completions):
            raise ValueError(f"request id {request_id!r} is already in use")
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [
            Request(seq_id, token_ids, seq_params, self.eos_token_ids, now, index=i,
                    parent_id=request_id if params.n > 1 else None)
            for i, (seq_id, seq_params) in enumerate(completions)
        ]
        if params.bad_words:
            words = bad_word_ids(self.tokenizer, params.bad_words)
            for seq in seqs:
                seq.bad_word_ids = words
        # The first computes the prompt; the others fork from it (Scheduler._fork_children).
        seqs[0].pending_children = seqs[1:]
        return seqs

    # ---- one step --------------------------------------------------------------

    def step(self, forward: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
             ) -> list[RequestOutput]:
        """Schedule, run the model, sample, and return the outputs of the
        requests that got a token or finished. The model runs inside
        ``forward()``; it reads the scheduler's output, never the scheduler
        or the block tables themselves."""
        sched = self.scheduler.schedule()
        self.layer_streams.scheduled(sched)
        if not sched:
            self._forget_if_idle(sched)
            return []
        with self.layer_streams.step(sched, self.runner.model), forward():
            result = self.runner.execute(sched)
        self.num_steps += 1
        outputs = self._process(self.scheduler.update(sched, result))
        if not self.scheduler.has_unfinished():
            self._forget_if_idle(self.scheduler.schedule())
        return outputs

    def _forget_if_idle(self, sched: SchedulerOutput) -> None:
        """Nothing runs: let the runner drop the requests that are gone now
        rather than at the next step, whenever that comes."""
        if sched.finished_ids:
            self.runner.execute(sched)

    def _process(self, changed: list[Request]) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(changed)
        for seq_id in stopped:  # a stop string matched
            self.scheduler.finish(seq_id, RequestStatus.FINISHED_STOPPED)
        return outputs

    def shutdown(self) -> None:
        """Stop the tensor-parallel follower processes, if any. Idempotent."""
        self.runner.shutdown()

    def on_unusable(self, callback: Callable[[], None]) -> None:
        """``callback()`` (from any thread) once the engine can no longer
        step: its tensor-parallel group broke (EngineUnusable)."""
        self.runner.tp.on_broken.append(callback)

