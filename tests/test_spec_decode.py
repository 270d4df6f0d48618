"""Speculative decoding (engine/spec_decode/): greedy output is the same with
and without it, the sampled path keeps the target distribution, and the KV
bookkeeping gives every block back.

Random tiny models never repeat themselves, so n-gram lookups would never
hit on them: two ways around that, each asserting that drafts were accepted
(and rejected), so no test passes vacuously:

- an *oracle* proposer (the Proposer interface is the plug) proposes the
  continuation a run without speculation produced, with every third
  proposal corrupted: acceptance, rejection and rollback on models whose
  attention matters;
- *bigram* models: the tiny models with each attention output projection
  zeroed, whose next token depends on the last one alone, so greedy output
  cycles and the real n-gram proposer hits, also across processes.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    assert_all_free,
    make_engine,
    random_prompts,
    record_steps,
    root,
    run_to_completion,
    tiny,
    tiny_with_tokenizer,
)
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model

from engine.sampling_params import SamplingParams
from engine.spec_config import SpeculativeConfig
from engine.spec_decode.base import DraftRequest, Proposal, Proposer
from engine.spec_decode.cost import FixedCosts
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.verify import VerifyRows, verify

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
# Decisions without timing: a guess costs nothing (engine/spec_decode/cost.py).
EVERY_GUESS_PAYS = FixedCosts(token=1.0, step=0.0, row=0.0)


class OracleProposer(Proposer):
    """Proposes what a run without speculation produced next; every third
    proposal has its second token (or its only one) wrong."""

    name = "oracle"

    def __init__(self, expected: list[list[int]]) -> None:
        self.expected = expected
        self.calls = 0

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            self.calls += 1
            n = len(r.token_ids)
            cont = next((full[n : n + r.max_tokens] for full in self.expected
                         if full[:n] == r.token_ids), [])
            if self.calls % 3 == 0 and cont:
                j = min(1, len(cont) - 1)
                cont = [*cont[:j], (cont[j] + 1) % VOCAB, *cont[j + 1 :]]
            out.append(Proposal(cont))
        return out


def bigram(name: str) -> str:
    """A copy of the tiny model (with the toy tokenizer) whose attention
    outputs are zeroed: the next token is a function of the last one."""
    path = root() / f"{name}-bigram"
    if not path.exists():
        shutil.copytree(tiny_with_tokenizer(name), path)
        weights = path / "model.safetensors"
        tensors = load_file(weights)
        for key in tensors:
            if key.endswith("self_attn.o_proj.weight"):
                tensors[key] = torch.zeros_like(tensors[key])
        save_file(tensors, weights, metadata={"format": "pt"})
    return str(path)


def generate(engine, prompts, params) -> dict[str, list[int]]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    done = run_to_completion(engine)
    return {k: [c.token_ids for c in v.outputs] for k, v in done.items()}


def spec_stats(engine):
    stats = engine.stats().spec_decode
    assert stats is not None
    return stats


# ---- configuration ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    {"method": "ngram", "num_speculative_tokens": 0},
    {"method": "ngram"},
    {"method": "medusa", "num_speculative_tokens": 2},
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
     "prompt_lookup_max": 2},
    {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1},
    {"method": "draft_model", "num_speculative_tokens": 2},
    "not a dict",
])
def test_bad_config_is_a_value_error(bad):
    with pytest.raises(ValueError):
        SpeculativeConfig.from_dict(bad)


def test_config_from_flag_and_keyword():
    import argparse

    from engine.cli_args import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert config_from_args(args).speculative_config == SpeculativeConfig(**NGRAM)
    with pytest.raises(SystemExit):  # argparse's usage error, not a stack trace
        parser.parse_args(["--speculative-config", "{not json"])
    draft = SpeculativeConfig.from_dict({"model": "/x", "num_speculative_tokens": 3})
    assert draft.method == "draft_model"


@pytest.mark.parametrize("change,match", [
    (dict(vocab_size=256), "vocabulary"),
    (dict(hidden_size=128, intermediate_size=256), "larger"),
    (dict(max_position_embeddings=64), "context"),
])
def test_a_draft_that_cannot_serve_fails_at_start(change, match):
    d, _ = tiny()
    name = "-".join(change)
    draft, _ = build_tiny_model("llama-gqa", root() / f"draft-{name}", **change)
    with pytest.raises(ValueError, match=match):
        make_engine(d, speculative_config={"model": str(draft), "num_speculative_tokens": 2})


def test_ngram_lookup_takes_the_latest_longest_match():
    ng = NgramProposer(min_n=2, max_n=3)
    assert ng.lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 2) == [7, 5]  # latest "2 3"
    assert ng.lookup([1, 2, 3, 4, 8, 2, 3, 5, 1, 2, 3], 3) == [4, 8, 2]  # "1 2 3" beats "2 3"
    assert ng.lookup([1, 2, 3, 1, 2], 5) == [3, 1, 2]
    assert ng.lookup([1, 2, 3, 4], 3) == []
    assert ng.lookup([5, 5], 3) == []  # shorter than min_n + 1


# ---- greedy: the same tokens ----------------------------------------------------------


SETUPS = {
    "plain": {},
    "chunked": dict(max_num_batched_tokens=24, long_prefill_token_threshold=16),
    "preemption": dict(num_blocks=30, block_size=4),
}


@pytest.mark.parametrize("model,setup", [("llama-gqa", setup) for setup in SETUPS]
                         + [("qwen2", "preemption")])
def test_greedy_output_is_unchanged_with_oracle_proposals(model, setup):
    d, _ = tiny(model)
    prompts = random_prompts([5, 40, 17, 70], seed=5)
    ref = generate(make_engine(d, **SETUPS[setup]), prompts, GREEDY)
    engine = make_engine(d, speculative_config={"num_speculative_tokens": 3}, **SETUPS[setup])
    engine.spec.proposer = OracleProposer([p + ref[str(i)][0] for i, p in enumerate(prompts)])
    engine.spec.cost = EVERY_GUESS_PAYS
    steps = record_steps(engine)
    assert generate(engine, prompts, GREEDY) == ref
    stats = spec_stats(engine)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if setup == "preemption":
        assert any(s.preempted for s in steps)
    assert_all_free(engine)


class WrongProposer(Proposer):
    name = "wrong"

    def propose(self, requests):  # token 0 (<unk>) never comes out of these models greedily
        return [Proposal([0] * r.max_tokens) for r in requests]


def test_blocks_of_rejected_drafts_are_given_back():
    """Every draft rejected, 2-token blocks, 4 drafts: after each step a
    request holds no block past those its real tokens fill, and the runner's
    block table follows (the output is still right)."""
    d, _ = tiny()
    prompts = random_prompts([5, 8], seed=4)
    ref = generate(make_engine(d, block_size=2), prompts, GREEDY)
    engine = make_engine(d, block_size=2, speculative_config={"num_speculative_tokens": 4})
    engine.spec.proposer = WrongProposer()
    engine.spec.cost = EVERY_GUESS_PAYS  # no pause: every step rolls 4 drafts back
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    done, checked = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        for request in engine.scheduler.running:
            assert engine.kv.num_held(request.request_id) <= \
                engine.kv.num_blocks_for(request.num_tokens)
            checked += 1
    assert done == ref and checked > 0
    stats = spec_stats(engine)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == 0
    assert_all_free(engine)


@pytest.mark.parametrize("backend", ["triton", "torch-reference"])
def test_verification_on_the_other_attention_paths(backend):
    """Several query tokens per decoding sequence through the Triton kernels
    (Triton's CPU interpreter here) and through kernels/reference.py (the
    torch backend off the CPU C kernel)."""
    d, _ = tiny()
    prompts = random_prompts([5, 9], seed=6)
    kw = dict(block_size=4, num_blocks=64,
              attention_backend="triton" if backend == "triton" else "torch")
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    ref = generate(make_engine(d, **kw), prompts, params)
    engine = make_engine(d, speculative_config={"num_speculative_tokens": 3}, **kw)
    if backend == "torch-reference":
        engine.runner.backend.native = False
    engine.spec.proposer = OracleProposer([p + ref[str(i)][0] for i, p in enumerate(prompts)])
    engine.spec.cost = EVERY_GUESS_PAYS
    assert generate(engine, prompts, params) == ref
    assert 0 < spec_stats(engine).num_accepted_tokens < spec_stats(engine).num_draft_tokens
    assert_all_free(engine)


def test_draft_model_greedy_output_is_unchanged():
    """The target as its own draft: every guess is right (and the output the
    same); a one-layer random draft: guesses are wrong, output still the same."""
    d, _ = tiny()
    one_layer, _ = build_tiny_model("llama-gqa", root() / "draft-1-layer", num_hidden_layers=1)
    prompts = random_prompts([5, 40], seed=5)
    ref = generate(make_engine(d), prompts, GREEDY)
    for draft in (d, one_layer):
        engine = make_engine(d, speculative_config={"model": str(draft),
                                                    "num_speculative_tokens": 3})
        assert generate(engine, prompts, GREEDY) == ref
        stats = spec_stats(engine)
        assert stats.num_drafts > 0
        if draft == d:
            assert stats.num_accepted_tokens > stats.num_draft_tokens * 0.9
        assert_all_free(engine)
        assert_all_free(engine.spec.proposer.engine)
        draft_pool = engine.spec.proposer.engine.kv.pool
        assert draft_pool.free_block_ids()[1]  # the draft cached its sequences' blocks
        engine.reset_prefix_cache()  # forgets the draft's prefixes too
        assert draft_pool.free_block_ids()[1] == []


def test_a_failed_draft_step_leaves_nothing_behind():
    """The draft engine fails mid-proposal: the target's step fails, the
    recovery forgets the draft's prefixes, and the next requests speculate
    and decode as if it never happened."""
    d, _ = tiny()
    prompts = random_prompts([12, 20], seed=6)
    ref = generate(make_engine(d), prompts, GREEDY)
    engine = make_engine(d, speculative_config={"model": str(d), "num_speculative_tokens": 2})
    draft = engine.spec.proposer.engine
    forward = draft.runner.model.forward
    calls = {"n": 0}

    def fail_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # past the draft's first prefill: inside a proposal
            raise RuntimeError("draft step failed")
        return forward(*args, **kwargs)

    draft.runner.model.forward = fail_once  # the model fails, as a real step would
    for i, prompt in enumerate(prompts):
        engine.add_request(f"f{i}", prompt, GREEDY)
    with pytest.raises(RuntimeError, match="draft step failed"):
        for _ in range(100):
            engine.step()
    assert not draft.has_unfinished_requests()  # the failed proposal's requests are gone
    engine.recover_from_failed_step()
    assert draft.kv.pool.free_block_ids()[1] == []  # and nothing it cached stays
    assert generate(engine, prompts, GREEDY) == ref
    assert_all_free(engine)
    assert_all_free(draft)


@pytest.mark.parametrize("model", ["llama-gqa", "qwen2"])
def test_ngram_greedy_output_is_unchanged(model):
    d = bigram(model)
    prompts = random_prompts([6, 9, 30], seed=7)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref = generate(make_engine(d), prompts, params)
    engine = make_engine(d, speculative_config=NGRAM)
    assert generate(engine, prompts, params) == ref
    stats = spec_stats(engine)
    assert stats.num_accepted_tokens > 0 and stats.accepted_per_pos[0] > 0
    assert_all_free(engine)


def test_constrained_requests_speculate_within_their_grammar():
    """A structured output's draft is cut to what its grammar allows and its
    verified rows masked: the greedy text is the one without speculation,
    inside the grammar, and drafts were accepted (the bigram model cycles,
    so n-gram lookups hit within the grammar too)."""
    d = bigram("llama-gqa")
    prompts = random_prompts([6, 9, 12], seed=7)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    constrained = [SamplingParams(temperature=0, max_tokens=40,
                                  structured_outputs={"regex": pattern})
                   for pattern in ("[a-d]{30}", "[0-9]{3}-[a-c]{2}")]
    params = [free, *constrained]
    ref = generate(make_engine(d), prompts, params)
    engine = make_engine(d, speculative_config=NGRAM)
    out = generate(engine, prompts, params)
    assert out == ref
    texts = [engine.tokenizer.decode(out[k][0]) for k in ("1", "2")]
    assert re.fullmatch("[a-d]{30}", texts[0]) and re.fullmatch("[0-9]{3}-[a-c]{2}", texts[1])
    assert spec_stats(engine).num_accepted_tokens > 0
    alone = make_engine(d, speculative_config=NGRAM)
    assert generate(alone, prompts[1:2], constrained[:1]) == {"0": ref["1"]}
    assert spec_stats(alone).num_accepted_tokens > 0  # the constrained request itself
    assert_all_free(engine)
    assert_all_free(alone)


def test_prefix_hits_and_n_2_with_speculation():
    d = bigram("llama-gqa")
    shared = random_prompts([40], seed=8)[0]
    prompts = [shared + [5], shared + [9]]  # the second finds the first's blocks cached
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
    base = make_engine(d)
    ref = {k: generate(base, [p], params)["0"] for k, p in enumerate(prompts)}
    engine = make_engine(d, speculative_config=NGRAM)
    out = {k: generate(engine, [p], params)["0"] for k, p in enumerate(prompts)}
    assert out == ref
    assert engine.stats().prefix_hits >= 32
    assert spec_stats(engine).num_accepted_tokens > 0
    assert_all_free(engine)


def test_stop_string_and_max_tokens_inside_an_accepted_run():
    d = bigram("llama-gqa")
    prompt = random_prompts([8], seed=11)[0]
    base = make_engine(d)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    text = run_one(base, prompt, long).text
    # A stop string from the repeating part, and a max_tokens that ends mid-run.
    stop = text[len(text) * 2 // 3 :][:4]
    cases = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[stop]),
             SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=60)]
    engine = make_engine(d, speculative_config=NGRAM)
    for p in cases:
        want, got = run_one(base, prompt, p), run_one(engine, prompt, p)
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert spec_stats(engine).num_accepted_tokens > 0
    assert_all_free(engine)


def run_one(engine, prompt, params):
    engine.add_request("one", prompt, params)
    return run_to_completion(engine)["one"].outputs[0]


def test_abort_in_the_middle_of_speculation_frees_everything():
    d = bigram("llama-gqa")
    engine = make_engine(d, speculative_config=NGRAM, block_size=4)
    for i, p in enumerate(random_prompts([6, 9], seed=7)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=200,
                                                     ignore_eos=True))
    for _ in range(40):
        engine.step()
    assert spec_stats(engine).num_drafts > 0
    engine.abort_request(["0", "1"])
    assert_all_free(engine)


# ---- sampling: the target distribution ------------------------------------------------


def chi2_critical(df: int) -> float:
    """The 0.999 quantile of chi-square with ``df`` degrees of freedom
    (Wilson-Hilferty; close enough for a test threshold)."""
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


class _Params:
    def __init__(self, **kw):
        self.params = SamplingParams(**kw)


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("draft_kind", ["point", "distribution"])
def test_rejection_sampling_emits_the_target_distribution(draft_kind, seeded):
    """Many one-token proposals verified in one call: the first emitted
    token follows the target's softmax (chi-square), whatever the draft's q,
    by the exponential race (point masses, seeded) or the general rule."""
    vocab, trials = 6, 4000
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the unseeded rows' draws
    row = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.0] * 6])
    target = torch.softmax(row[0], dim=-1)
    q = torch.tensor([[0.05, 0.1, 0.6, 0.1, 0.1, 0.05]]) if draft_kind == "distribution" else None
    drafts = [2] * trials if q is None else \
        torch.multinomial(q[0], trials, replacement=True, generator=gen).tolist()
    state = _Params(temperature=1.0)
    seqs = [VerifyRows(state, [d], q, gen if seeded else None, 2 * i)
            for i, d in enumerate(drafts)]
    emitted = verify(row.repeat(trials, 1), seqs, vocab)
    counts = torch.bincount(torch.tensor([t[0] for t in emitted]), minlength=vocab).float()
    expected = target * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(vocab - 1), (counts / trials, target)
    assert 0 < sum(len(t) == 2 for t in emitted) < trials  # some accepted, some not


class SameTokenProposer(Proposer):
    name = "fixed"

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, requests):
        return [Proposal([self.token] * r.max_tokens) for r in requests]


def test_sampled_engine_keeps_the_distribution_of_the_first_speculative_token():
    """The (first, second) token pairs of many unseeded samples, with and
    without speculation on the second: the same distribution (two-sample
    chi-square). Top-k 4 keeps the pairs few enough to count."""
    d, _ = tiny()
    prompt = random_prompts([7], seed=2)[0]
    greedy = generate(make_engine(d), [prompt], SamplingParams(temperature=0, max_tokens=2))
    second = greedy["0"][0][1]
    num = 400
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3)

    def pairs(engine):
        out = generate(engine, [prompt] * num, params)
        counts: dict[tuple[int, int], int] = {}
        for toks in out.values():
            key = (toks[0][0], toks[0][1])
            counts[key] = counts.get(key, 0) + 1
        return counts

    torch.manual_seed(0)
    base = pairs(make_engine(d, num_blocks=1024, max_num_seqs=num))
    engine = make_engine(d, num_blocks=1024, max_num_seqs=num,
                         speculative_config={"num_speculative_tokens": 1})
    engine.spec.proposer = SameTokenProposer(second)
    engine.spec.cost = EVERY_GUESS_PAYS
    spec = pairs(engine)
    stats = spec_stats(engine)
    assert stats.num_drafts == num and 0 < stats.num_accepted_tokens < num
    keys = set(base) | set(spec)
    chi2 = sum((base.get(k, 0) - spec.get(k, 0)) ** 2 / (base.get(k, 0) + spec.get(k, 0))
               for k in keys)
    assert chi2 < chi2_critical(len(keys) - 1), (base, spec)
    assert_all_free(engine)


def test_a_seed_gives_the_same_text_with_and_without_speculation():
    """Seeded samples draw one noise vector per emitted token, verifying or
    not (verify.py): the text of each seed is the one without speculation,
    whether the drafter guesses every time or never."""
    d = bigram("llama-gqa")
    prompts = random_prompts([6, 9, 12], seed=7)
    # Cool enough that the bigram model still cycles and n-gram lookups hit.
    params = [SamplingParams(temperature=0.5, max_tokens=40, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    ref = generate(make_engine(d), prompts, params)
    for costs in (EVERY_GUESS_PAYS, FixedCosts(token=1.0, step=0.0, row=2.0)):
        engine = make_engine(d, speculative_config=NGRAM)
        engine.spec.cost = costs
        assert generate(engine, prompts, params) == ref
        stats = spec_stats(engine)
        if costs is EVERY_GUESS_PAYS:
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        else:  # no guess pays: only probes, one guess each
            assert stats.num_draft_tokens == stats.num_drafts
        assert_all_free(engine)


def test_a_seed_gives_the_same_text_alone_or_in_a_batch():
    d = bigram("llama-gqa")
    prompts = random_prompts([6, 9, 12], seed=7)
    # Cool enough that the bigram model still cycles and n-gram lookups hit.
    seeded = SamplingParams(temperature=0.2, max_tokens=40, seed=42, ignore_eos=True)
    other = SamplingParams(temperature=0.2, max_tokens=40, ignore_eos=True)
    alone = generate(make_engine(d, speculative_config=NGRAM), prompts[:1], seeded)["0"]
    engine = make_engine(d, speculative_config=NGRAM)
    batched = generate(engine, prompts, [seeded, other, other])["0"]
    assert alone == batched
    assert spec_stats(engine).num_accepted_tokens > 0


# ---- the real model ---------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_repeats_text_the_same_with_speculation():
    from tandem import LLM

    text = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles "
            "begins with a single step.")
    chat = [{"role": "user", "content": f"Repeat this text exactly: {text}"}]
    params = SamplingParams(temperature=0, max_tokens=32)
    kw = dict(dtype="float32", num_blocks=64)
    want = LLM(**kw).chat(chat, params, use_tqdm=False)[0].outputs[0]
    llm = LLM(**kw, speculative_config=NGRAM)
    got = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


# ---- through a cluster ------------------------------------------------------------------


def test_disaggregated_equals_colocated_equals_offline():
    """Decode workers speculate (the flag), prefill workers do not; the text is
    the offline engine's, and the decode worker's metrics count accepted drafts."""
    from gateway_fixtures import start_gateway, start_workers, wait_blocks_free
    from worker_fixtures import metric, scrape

    from tandem.bench import spec_metrics
    from tandem.cluster import LocalCluster

    model = bigram("llama-gqa")
    prompt = "the quick brown fox"
    flag = ["--speculative-config", json.dumps(NGRAM)]
    offline = make_engine(model, speculative_config=NGRAM)
    want = run_one(offline, prompt, SamplingParams(temperature=0, max_tokens=40,
                                                   ignore_eos=True)).text
    assert spec_stats(offline).num_accepted_tokens > 0
    with LocalCluster() as cluster:
        split = start_workers(cluster, ["prefill", "decode"], 64, *flag, model=model, metrics=True)
        both = start_workers(cluster, ["both"], 64, *flag, model=model)
        texts = []
        for workers in (split, both):
            gateway = start_gateway(cluster, workers, model=model)
            with gateway.client() as client:
                texts.append(client.completions.create(
                    model="tiny-llama", prompt=prompt, max_tokens=40, temperature=0,
                    extra_body={"ignore_eos": True}).choices[0].text)
            wait_blocks_free(workers)
        assert texts == [want, want]
        decode_metrics = scrape(split[1].metrics_port)
        assert metric(decode_metrics, "vllm:spec_decode_num_accepted_tokens_total") > 0
        assert metric(decode_metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                      position="0") > 0
        assert not metric(scrape(split[0].metrics_port), "vllm:spec_decode_num_drafts_total")
        # What `tandem bench serve --metrics-url` reads.
        summary = spec_metrics.scrape(f"http://127.0.0.1:{split[1].metrics_port}/metrics").summary()
        assert summary is not None and 0 < summary["acceptance_rate"] <= 1


def test_draft_model_disaggregated_equals_colocated_equals_offline():
    """A decode worker speculating with a draft model behind a prefill worker
    (which runs the target only: the decode worker prefills the draft
    itself, docs/architecture.md) gives the offline text, and so does a
    colocated worker with a smaller draft (one layer, random weights, the
    same vocabulary)."""
    from gateway_fixtures import start_gateway, start_workers, wait_blocks_free
    from worker_fixtures import metric, scrape

    from tandem.cluster import LocalCluster

    model = bigram("llama-gqa")
    one_layer, _ = build_tiny_model("llama-gqa", root() / "draft-1-layer", num_hidden_layers=1)

    def flag(draft):
        return ["--speculative-config",
                json.dumps({"model": str(draft), "num_speculative_tokens": 3})]

    prompt = "the quick brown fox"
    want = run_one(make_engine(model), prompt, SamplingParams(temperature=0, max_tokens=40,
                                                              ignore_eos=True)).text
    with LocalCluster() as cluster:
        # The target as its own draft on the decode worker: its guesses hold.
        split = start_workers(cluster, ["prefill", "decode"], 64, *flag(model), model=model,
                              metrics=True)
        both = start_workers(cluster, ["both"], 64, *flag(one_layer), model=model, metrics=True)
        texts = []
        for workers in (split, both):
            gateway = start_gateway(cluster, workers, model=model)
            with gateway.client() as client:
                texts.append(client.completions.create(
                    model="tiny-llama", prompt=prompt, max_tokens=40, temperature=0,
                    extra_body={"ignore_eos": True}).choices[0].text)
            wait_blocks_free(workers)
        assert texts == [want, want]
        assert metric(scrape(split[1].metrics_port), "vllm:spec_decode_num_accepted_tokens_total") > 0
        assert metric(scrape(both[0].metrics_port), "vllm:spec_decode_num_drafts_total") > 0
        assert not metric(scrape(split[0].metrics_port), "vllm:spec_decode_num_drafts_total")
