"""A serving engine's first steps, taken before it serves.

A fresh engine's first full step costs far more than the ones after it:
the CPU matmuls pack their weights at first use, the kernels load, and
every activation buffer of a full step is new memory the kernel faults in
page by page. On 2 cores the bundled SmolLM2's first 2048-token prefill
step took 0.93 s against 0.33 s for the next one. Served, that lands on the
first burst's time to first token; so a worker runs one full step of
made-up prompts, and a decode step after it, before it says it is ready
(vLLM's server does its own dummy runs at start for the same reason). A
draft model for speculative decoding runs in an engine of its own, which is
warmed up the same way after the target.

Nothing of the warm-up stays: its requests finish, their blocks go back,
their prefixes leave the cache and speculation forgets what its steps cost.
The engine's counters do count its steps; a worker's metrics count from the
end of the warm-up (``WorkerMetrics.count_from``).
"""

from __future__ import annotations

import logging
import time

from engine.sampling_params import SamplingParams

logger = logging.getLogger("engine")

PROMPT_LEN = 128  # a typical prompt; a full step holds budget / PROMPT_LEN of them
OUTPUT_LEN = 2  # the prefill's token, then one decode step over the whole batch


def warmup_prompt(i: int, length: int, vocab_size: int) -> list[int]:
    """The ``i``-th warm-up prompt. Each starts with a token of its own, so
    no two share a prefix block (while there are fewer than ``vocab_size``)."""
    return [(i + j) % vocab_size for j in range(length)]


def warm_up(engine) -> float:
    """Run a full prefill step and a decode step of made-up prompts through
    ``engine`` (an ``LLMEngine`` with nothing queued); returns the seconds."""
    if engine.has_unfinished_requests():
        raise ValueError("warm up an engine before it takes requests")
    start = time.perf_counter()
    sched = engine.config.scheduler
    free_blocks = engine.stats().num_free_blocks
    # Each prompt in one chunk, so the first step holds the most prompts.
    prompt_len = min(PROMPT_LEN, sched.long_prefill_token_threshold or PROMPT_LEN,
                     engine.max_model_len - OUTPUT_LEN, free_blocks * engine.block_size - OUTPUT_LEN)
    if prompt_len < 1:  # a cache (or context) too small to warm anything up in
        logger.info("no warm-up: the KV cache or max_model_len holds no prompt")
        return 0.0
    fits = free_blocks // engine.num_blocks_for(prompt_len + OUTPUT_LEN)
    count = max(1, min(sched.max_num_batched_tokens // prompt_len, sched.max_num_seqs, fits))
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True, temperature=0.0)
    ids = [f"warmup-{i}" for i in range(count)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, warmup_prompt(i, prompt_len, vocab), params)
    try:
        # Each prompt is scheduled within a few steps; a bound in case one never is.
        for _ in range(count * (prompt_len + OUTPUT_LEN)):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        if engine.has_unfinished_requests():
            raise RuntimeError("the warm-up's requests did not finish")
    finally:
        engine.abort_request([r for r in ids if engine.has_request(r)])
        engine.reset_prefix_cache()
        if engine.spec is not None:
            # Its steps were the cold ones (a decode step of 7 rows took 60
            # ms of CPU here, against 1 ms warm at one row): left in the step
            # costs, they priced every verifying step out of speculation.
            engine.spec.cost.reset()
    if engine.draft_engine is not None:  # its first steps are costly too
        warm_up(engine.draft_engine)
    seconds = time.perf_counter() - start
    logger.info("warmed up in %.2f s: %d prompts of %d tokens, %d output tokens each",
                seconds, count, prompt_len, OUTPUT_LEN)
    return seconds
