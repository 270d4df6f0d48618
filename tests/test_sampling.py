"""Sampling parameters end to end on a tiny model, checked against Hugging
Face logits where there is an exact answer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_fixtures import (
    EOS,
    assert_all_free,
    hf_logprobs,
    make_engine,
    random_prompts,
    record_steps,
    root,
    run_to_completion,
    tiny,
)

from engine.sampling_params import SamplingParams

VARIANT = "llama-gqa"
PROMPTS = random_prompts((3, 9, 20, 33, 6, 14, 27, 1), seed=3)
PROMPT = PROMPTS[2]


@pytest.fixture(scope="module")
def model():
    return tiny(VARIANT)


@pytest.fixture
def engine(model):
    engine = make_engine(model[0], block_size=4, num_blocks=512)
    yield engine
    assert_all_free(engine)


def run(engine, requests: list[tuple[list[int], SamplingParams]], with_preemptions=False):
    """Add (prompt, params) pairs as r0, r1...; run them; outputs in order
    (and how many times a sequence was preempted)."""
    steps = record_steps(engine) if with_preemptions else []
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    done = run_to_completion(engine)
    outs = [done[f"r{i}"] for i in range(len(requests))]
    preemptions = sum(len(sched.preempted) for sched in steps)
    return (outs, preemptions) if with_preemptions else outs


def tokens(engine, prompt, params) -> list[int]:
    (out,) = run(engine, [(prompt, params)])
    return out.outputs[0].token_ids


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def greedy(max_tokens=12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def sampled(max_tokens=12, **kw) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


# ---- seeds ----------------------------------------------------------------------


def test_a_seed_gives_the_same_tokens_alone_and_in_a_batch(engine):
    seeded = sampled(max_tokens=16, seed=1234)
    alone = tokens(engine, PROMPT, seeded)
    assert tokens(engine, PROMPT, seeded) == alone
    others = [
        sampled(), greedy(), sampled(seed=5), sampled(top_k=5), sampled(top_p=0.8),
        sampled(min_p=0.1, presence_penalty=1.0), sampled(temperature=0.7, seed=99),
    ]
    batch = [(p, sp) for p, sp in zip(PROMPTS[:7], others)]
    batch.insert(3, (PROMPT, seeded))
    outs = run(engine, batch)
    assert outs[3].outputs[0].token_ids == alone


def test_different_seeds_differ(engine):
    a = tokens(engine, PROMPT, sampled(seed=1))
    b = tokens(engine, PROMPT, sampled(seed=2))
    assert a != b


def test_unseeded_sampling_varies(engine):
    outs = {tuple(tokens(engine, PROMPT, sampled())) for _ in range(3)}
    assert len(outs) > 1


# ---- filters that reduce to greedy -------------------------------------------------


def test_filters_that_leave_one_token_equal_greedy(engine):
    want = tokens(engine, PROMPT, greedy())
    for params in (
        sampled(top_k=1, seed=3),
        sampled(top_p=1e-6, seed=3),
        sampled(min_p=1.0, seed=3),
        sampled(temperature=5.0, top_k=1, seed=3),
    ):
        assert tokens(engine, PROMPT, params) == want, params


def test_a_tiny_temperature_is_raised_not_overflowed(engine):
    # logits / 1e-38 were inf: NaN probabilities, token 0 every step.
    params = sampled(temperature=1e-38, seed=3)
    assert params.temperature == 0.01
    got = tokens(engine, PROMPT, params)
    assert got == tokens(engine, PROMPT, sampled(temperature=0.01, seed=3))
    assert len(set(got)) > 1


def test_min_p_keeps_only_likely_tokens(engine, model):
    out = tokens(engine, PROMPT, sampled(max_tokens=20, min_p=0.3, temperature=2.0, seed=0))
    probs = torch.softmax(hf_logits(model[1], PROMPT + out) / 2.0, dim=-1)
    for i, token in enumerate(out):
        row = probs[len(PROMPT) - 1 + i]
        assert row[token] >= 0.3 * row.max() * (1 - 1e-4)


def test_top_k_keeps_only_the_k_best(engine, model):
    out = tokens(engine, PROMPT, sampled(max_tokens=20, top_k=3, temperature=3.0, seed=0))
    logits = hf_logits(model[1], PROMPT + out)
    for i, token in enumerate(out):
        assert token in logits[len(PROMPT) - 1 + i].topk(3).indices.tolist()


# ---- penalties ----------------------------------------------------------------------


def _expected_with_penalty(hf, prompt, out, params) -> list[int]:
    """Greedy next tokens under the penalties, from HF's logits, one per step."""
    logits = hf_logits(hf, prompt + out)
    expected = []
    for i in range(len(out)):
        row = logits[len(prompt) - 1 + i].clone()
        seen = prompt + out[:i]
        if params.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(seen)))
            vals = row[ids]
            row[ids] = torch.where(vals > 0, vals / params.repetition_penalty,
                                   vals * params.repetition_penalty)
        counts = torch.bincount(torch.tensor(out[:i], dtype=torch.long), minlength=row.shape[0])
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        expected.append(int(row.argmax()))
    return expected


@pytest.mark.parametrize("penalty", [
    dict(frequency_penalty=2.0), dict(presence_penalty=2.0), dict(repetition_penalty=3.0),
])
def test_penalties_match_a_reference_from_hf_logits(engine, model, penalty):
    params = greedy(max_tokens=24, **penalty)
    out = tokens(engine, PROMPT, params)
    assert out == _expected_with_penalty(model[1], PROMPT, out, params)
    assert out != tokens(engine, PROMPT, greedy(max_tokens=24))  # the penalty mattered


def test_frequency_penalty_reduces_repeats(engine):
    prompt = PROMPTS[0]
    plain = tokens(engine, prompt, greedy(max_tokens=40))
    penalized = tokens(engine, prompt, greedy(max_tokens=40, frequency_penalty=2.0))
    repeats = lambda ts: len(ts) - len(set(ts))  # noqa: E731
    assert repeats(plain) > 0  # a random model loops under greedy
    assert repeats(penalized) < repeats(plain)


# ---- stopping -----------------------------------------------------------------------


def test_max_tokens_finishes_with_length(engine):
    (out,) = run(engine, [(PROMPT, greedy(max_tokens=5))])
    comp = out.outputs[0]
    assert len(comp.token_ids) == 5 and comp.finish_reason == "length" and out.finished
    assert comp.stop_reason is None


def test_stop_token_ids(engine):
    plain = tokens(engine, PROMPT, greedy(max_tokens=16))
    stop = plain[5]
    first = plain.index(stop)
    (out,) = run(engine, [(PROMPT, greedy(max_tokens=16, stop_token_ids=[stop]))])
    comp = out.outputs[0]
    assert comp.token_ids == plain[: first + 1]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    # min_tokens bans the stop token until enough tokens are out.
    (out,) = run(engine, [(PROMPT, greedy(max_tokens=16, min_tokens=first + 2,
                                            stop_token_ids=[stop]))])
    comp = out.outputs[0]
    assert stop not in comp.token_ids[: first + 2]
    assert comp.token_ids[:first] == plain[:first]


@pytest.fixture(scope="module")
def eos_model(model):
    """The tiny model with its eos id moved to a token greedy decoding emits
    early on (a random model never picks id 2 by itself)."""
    engine = make_engine(model[0])
    plain = tokens(engine, PROMPT, greedy(max_tokens=16))
    eos = plain[4]
    path = root() / f"{VARIANT}-eos{eos}"
    if not path.exists():
        shutil.copytree(model[0], path)
        cfg = json.loads((path / "config.json").read_text())
        cfg["eos_token_id"] = eos
        (path / "config.json").write_text(json.dumps(cfg))
    return path, plain, eos


def test_the_tiny_models_eos_is_2(model):
    assert make_engine(model[0]).eos_token_ids == (EOS,)


def test_eos_ignore_eos_and_min_tokens(eos_model):
    path, plain, eos = eos_model
    engine = make_engine(path, block_size=4)
    first = plain.index(eos)
    params = SamplingParams(temperature=0, max_tokens=16)
    (out,) = run(engine, [(PROMPT, params)])
    comp = out.outputs[0]
    assert comp.token_ids == plain[: first + 1]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", None)
    (out,) = run(engine, [(PROMPT, greedy(max_tokens=16))])  # ignore_eos
    assert out.outputs[0].token_ids == plain and out.outputs[0].finish_reason == "length"
    (out,) = run(engine, [(PROMPT, SamplingParams(temperature=0, max_tokens=16,
                                                  min_tokens=first + 3))])
    comp = out.outputs[0]
    assert eos not in comp.token_ids[: first + 3] and comp.token_ids[:first] == plain[:first]
    assert len(comp.token_ids) >= first + 3
    assert_all_free(engine)


# ---- n > 1 ------------------------------------------------------------------------------


def test_n_completions(engine):
    (out,) = run(engine, [(PROMPT, sampled(n=4, seed=11))])
    comps = out.outputs
    assert [c.index for c in comps] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in comps)
    assert len({tuple(c.token_ids) for c in comps}) == 4
    (again,) = run(engine, [(PROMPT, sampled(n=4, seed=11))])
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in comps]
    (out,) = run(engine, [(PROMPT, greedy(n=3))])
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert out.outputs[0].token_ids == tokens(engine, PROMPT, greedy())


def test_completion_i_of_n_is_the_request_with_seed_plus_i(engine):
    """The one rule for n (engine/completions.py) that the gateway relies on
    when it spreads the completions over workers as requests of their own."""
    (out,) = run(engine, [(PROMPT, sampled(n=3, seed=7))])
    alone = run(engine, [(PROMPT, sampled(seed=7 + i)) for i in range(3)])
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in alone]
    from gateway.sequence import fork

    seqs = fork("r", PROMPT, sampled(n=3, seed=7))
    assert [(s.request_id, s.params.seed, s.params.n) for s in seqs] == [
        ("r#0", 7, 1), ("r#1", 8, 1), ("r#2", 9, 1)]


def test_n_completions_share_the_prompt_blocks(engine):
    engine.add_request("r", PROMPT, greedy(n=3))  # 20 tokens: 5 blocks of 4
    engine.step()  # the prompt; the children fork from it
    engine.step()
    tables = [engine.kv_progress(seq_id).block_ids for seq_id in ("r#0", "r#1", "r#2")]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]  # blocks 0-3 shared
    assert len({t[4] for t in tables}) == 3  # the last prompt block is each one's own
    stats = engine.stats()  # each shared block is held once
    assert stats.num_free_blocks == stats.num_blocks - len(set().union(*tables))
    run_to_completion(engine)


# ---- logprobs ---------------------------------------------------------------------------


def test_logprobs_equal_hf_log_softmax(engine, model):
    params = sampled(max_tokens=10, seed=5, logprobs=5, temperature=1.5)
    (out,) = run(engine, [(PROMPT, params)])
    comp = out.outputs[0]
    ref = hf_logprobs(model[1], PROMPT + comp.token_ids)
    assert len(comp.logprobs) == len(comp.token_ids)
    for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(PROMPT) - 1 + i]
        top = row.topk(5).indices.tolist()
        assert token in entry and set(top) <= set(entry) and len(entry) <= 6
        assert set(entry) == set(top) | {token}
        for tid, lp in entry.items():
            assert lp == pytest.approx(row[tid].item(), abs=1e-4)
    assert any(token not in ref[len(PROMPT) - 1 + i].topk(5).indices.tolist()
               for i, token in enumerate(comp.token_ids))  # sampled outside the top 5


def test_logprobs_zero_gives_the_sampled_token_only(engine, model):
    (out,) = run(engine, [(PROMPT, greedy(max_tokens=4, logprobs=0))])
    comp = out.outputs[0]
    ref = hf_logprobs(model[1], PROMPT + comp.token_ids)
    for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert list(entry) == [token]
        assert entry[token] == pytest.approx(ref[len(PROMPT) - 1 + i, token].item(), abs=1e-4)
    (out,) = run(engine, [(PROMPT, greedy(max_tokens=4))])
    assert out.outputs[0].logprobs is None


def _check_prompt_logprobs(hf, prompt, got, n):
    ref = hf_logprobs(hf, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        entry, row = got[p], ref[p - 1]
        assert set(entry) == set(row.topk(n).indices.tolist()) | {prompt[p]}
        for tid, lp in entry.items():
            assert lp == pytest.approx(row[tid].item(), abs=1e-4)


@pytest.mark.parametrize("budget,num_blocks", [(2048, 512), (8, 512), (8, 12)],
                         ids=["whole", "chunked", "chunked-preempted"])
def test_prompt_logprobs_equal_hf(model, budget, num_blocks):
    engine = make_engine(model[0], block_size=4, num_blocks=num_blocks,
                         max_num_batched_tokens=budget)
    long_prompt = random_prompts((30,), seed=9)[0]
    reqs = [(PROMPT, greedy(prompt_logprobs=3)), (long_prompt, greedy(prompt_logprobs=2)),
            (PROMPTS[0], greedy()), (PROMPTS[3], greedy())]
    outs, preemptions = run(engine, reqs, with_preemptions=True)
    _check_prompt_logprobs(model[1], PROMPT, outs[0].prompt_logprobs, 3)
    _check_prompt_logprobs(model[1], long_prompt, outs[1].prompt_logprobs, 2)
    assert outs[2].prompt_logprobs is None
    assert (preemptions > 0) == (num_blocks == 12)
    assert_all_free(engine)


def test_prompt_logprobs_with_n_and_a_one_token_prompt(engine, model):
    outs = run(engine, [(PROMPT, sampled(n=2, seed=1, prompt_logprobs=1)),
                        ([PROMPT[0]], greedy(prompt_logprobs=1))])
    _check_prompt_logprobs(model[1], PROMPT, outs[0].prompt_logprobs, 1)
    assert outs[1].prompt_logprobs == [None]


def test_logit_bias_and_allowed_tokens_are_built_once_per_request():
    from types import SimpleNamespace

    from engine.sampler import _apply_penalties_and_bans

    params = SamplingParams(logit_bias={1: 5.0, 3: -2.0}, allowed_token_ids=[1, 2, 3])
    request = SimpleNamespace(params=params, bad_word_ids=[], num_output_tokens=0,
                              token_ids=[], output_token_ids=[])
    logits = torch.zeros(2, 6)
    first = _apply_penalties_and_bans(logits, [request, request])
    inf = float("-inf")
    assert first[0].tolist() == [inf, 5.0, 0.0, -2.0, inf, inf] == first[1].tolist()
    kept = request.logit_offsets[1]
    again = _apply_penalties_and_bans(logits, [request])
    assert request.logit_offsets[1] is kept  # not rebuilt from the lists
    assert again[0].tolist() == first[0].tolist()


def test_logprob_entries_rank_only_the_rows_that_ask():
    """Rows without logprobs get None; every other row the entry it gets
    alone (the subset is indexed, not the whole batch ranked)."""
    from engine.sampler import logprob_entries

    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(4, 50), dim=-1)
    tokens = torch.tensor([3, 7, 11, 40])
    top_n = [None, 2, None, 0]
    entries = logprob_entries(logprobs, tokens, top_n)
    assert entries[0] is None and entries[2] is None
    for row in (1, 3):
        alone = logprob_entries(logprobs[row:row + 1], tokens[row:row + 1], [top_n[row]])[0]
        assert entries[row] == alone
        assert [v.rank for v in entries[row].values()] == [v.rank for v in alone.values()]
    assert len(entries[1]) in (2, 3) and list(entries[3]) == [40]
