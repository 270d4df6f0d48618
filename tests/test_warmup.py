"""engine/warmup.py: a worker's steps before it serves leave nothing behind."""

from __future__ import annotations

import pytest
from engine_fixtures import make_engine, run_to_completion, tiny

from engine.sampling_params import SamplingParams
from engine.warmup import OUTPUT_LEN, PROMPT_LEN, warm_up, warmup_prompt

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _first_warmup_prompt(engine) -> list[int]:
    n = min(PROMPT_LEN, engine.max_model_len - OUTPUT_LEN)
    return warmup_prompt(0, n, engine.model_config.vocab_size)


def test_a_warm_engine_holds_no_blocks_or_prefixes():
    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=256, block_size=4, enable_prefix_caching=True)
    steps_before = engine.stats().num_steps
    warm_up(engine)
    stats = engine.stats()
    assert stats.num_steps == steps_before + OUTPUT_LEN  # it did run: a prefill and a decode
    assert stats.num_free_blocks == stats.num_blocks
    assert (stats.num_requests, stats.num_sequences) == (0, 0)
    # Its prompts are not cached: the same prompt again is computed anew.
    engine.add_request("again", _first_warmup_prompt(engine), GREEDY)
    run_to_completion(engine)
    assert engine.stats().prefix_hits == stats.prefix_hits


def test_a_workers_metrics_count_from_the_end_of_its_warm_up():
    from prometheus_client import generate_latest

    from worker.metrics import WorkerMetrics

    def counted(metrics, name):
        for line in generate_latest(metrics.registry).decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not exported")

    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=256, block_size=4, enable_prefix_caching=True)
    warm_up(engine)
    warm = engine.stats()
    assert warm.prefix_queries > 0  # the engine's totals include the warm-up
    metrics = WorkerMetrics("w", "decode")
    metrics.count_from(warm)
    metrics.observe_engine(engine)
    assert counted(metrics, "vllm:prefix_cache_queries_total") == 0
    prompt = list(range(3, 3 + 12))
    for i in range(2):  # the second finds the first's 3 full blocks cached
        engine.add_request(f"r{i}", prompt, GREEDY)
        run_to_completion(engine)
    metrics.observe_engine(engine)
    assert counted(metrics, "vllm:prefix_cache_queries_total") == 2 * len(prompt)
    assert counted(metrics, "vllm:prefix_cache_hits_total") == 8  # 2 blocks: the last is recomputed


def test_core_lease_steps_of_the_warm_up_are_not_counted():
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from worker.metrics import WorkerMetrics

    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=64, block_size=4)
    metrics = WorkerMetrics("w", "decode")
    cores = SimpleNamespace(steps_borrowing=2, steps_lent=1)  # a warm-up step borrowed cores
    metrics.count_from(engine.stats(), cores)
    metrics.observe_cores(cores.steps_borrowing + 1, cores.steps_lent)  # one served step since
    text = generate_latest(metrics.registry).decode()
    assert "tandem:cpu_borrowed_steps_total 1.0" in text
    assert "tandem:cpu_lent_steps_total 0.0" in text


def test_outputs_after_a_warm_up_are_those_of_a_fresh_engine():
    model_dir, _ = tiny("llama-gqa")
    prompts = [[5, 9, 13, 2, 7], list(range(10, 40)), [3] * 17]
    outputs = []
    for warm in (False, True):
        engine = make_engine(model_dir, num_blocks=256, block_size=4)
        if warm:
            warm_up(engine)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, GREEDY)
        done = run_to_completion(engine)
        outputs.append([done[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))])
    assert outputs[0] == outputs[1]


def test_a_small_cache_warms_up_with_what_fits():
    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=40, block_size=4)  # 160 tokens: one prompt
    warm_up(engine)
    assert engine.stats().num_steps == OUTPUT_LEN  # it ran, in the blocks it had
    assert engine.stats().num_free_blocks == 40


def test_a_draft_models_engine_is_warmed_up_too():
    from engine_fixtures import root
    from tiny_models import build_tiny_model

    model_dir, _ = tiny("llama-gqa")
    draft_dir, _ = build_tiny_model("llama-gqa", root() / "draft-1-layer", num_hidden_layers=1)
    engine = make_engine(model_dir, num_blocks=256, block_size=4,
                         speculative_config={"model": str(draft_dir), "num_speculative_tokens": 2})
    draft = engine.spec.proposer.engine
    warm_up(engine)
    assert draft.stats().num_steps >= OUTPUT_LEN  # its own prefill and decode steps ran
    assert draft.stats().num_free_blocks == draft.stats().num_blocks
    assert draft.kv.pool.free_block_ids()[1] == []  # nothing of the warm-up stays cached


def test_speculation_prices_steps_from_the_first_served_one():
    """The warm-up's decode step is the cold one (first-use packing and page
    faults): kept in the step costs, its price at the warm-up's batch size set
    the slope of every larger step, and a decode worker stopped speculating."""
    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=256, block_size=4,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    warm_up(engine)
    assert engine.stats().num_steps == OUTPUT_LEN  # its decode step was timed, then forgotten
    assert engine.spec.cost.snapshot() == {"plain": {}, "verify": {}}
    assert not engine.spec.cost.calibrated


def test_an_engine_with_requests_is_not_warmed_up():
    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=64, block_size=4)
    engine.add_request("real", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="before it takes requests"):
        warm_up(engine)
    done = run_to_completion(engine)  # the queued request is untouched
    assert len(done["real"].outputs[0].token_ids) == GREEDY.max_tokens


def test_a_cache_too_small_for_any_prompt_skips_the_warm_up():
    model_dir, _ = tiny("llama-gqa")
    engine = make_engine(model_dir, num_blocks=1, block_size=2)  # 2 tokens: no prompt + 2
    assert warm_up(engine) == 0.0
    assert engine.stats().num_steps == 0 and engine.stats().num_free_blocks == 1
