"""The scheduler with fake requests and no model: every step is schedule(),
a made-up sampled token per sampling request, update()."""

from __future__ import annotations

import itertools

import pytest

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import ModelRunnerOutput

BS = 4
_tokens = itertools.count(1000)


def make_scheduler(num_blocks=64, budget=2048, max_num_seqs=256, caching=True, max_model_len=512,
                   long_prefill=None):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          long_prefill_token_threshold=long_prefill)
    return Scheduler(cfg, kv, max_model_len)


def make_request(rid: str, prompt_len: int, max_tokens: int = 16, n: int = 1, **params) -> Request:
    """A request whose prompt tokens are unique (no accidental prefix hits)."""
    prompt = [next(_tokens) for _ in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, **params)
    request = Request(rid, prompt, sp, eos_token_ids=(2,))
    request.pending_children = [
        Request(f"{rid}#{i}", prompt, sp, (2,), index=i, parent_id=rid) for i in range(1, n)
    ]
    return request


def step(sched: Scheduler, token: int = 7):
    """One step; returns [(request_id, start, num_new_tokens)] and the output."""
    out = sched.schedule()
    sampled = {s.request_id: token for s in out.scheduled if s.sample}
    sched.update(out, ModelRunnerOutput(sampled))
    return [(s.request_id, s.start, s.num_new_tokens) for s in out.scheduled], out


def drain(sched: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("scheduler did not drain")


def assert_empty(sched: Scheduler) -> None:
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert not sched.requests and not sched.running and not sched.waiting and not sched.remote
    assert not sched.kv._blocks


def test_chunked_prefill_mixes_with_decodes_under_the_token_budget():
    sched = make_scheduler(budget=10)
    sched.add_request(make_request("a", 4))
    assert step(sched)[0] == [("a", 0, 4)]
    sched.add_request(make_request("b", 20))
    # The decode comes first and takes one token; the prefill gets the rest.
    out = sched.schedule()
    assert [(s.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 4, 1), ("b", 0, 9),
    ]
    assert out.num_batched_tokens == 10 and out.num_decodes == 1
    assert [s.sample for s in out.scheduled] == [True, False]
    sched.update(out, ModelRunnerOutput({"a": 7}))
    assert step(sched)[0] == [("a", 5, 1), ("b", 9, 9)]
    got, out = step(sched)
    assert got == [("a", 6, 1), ("b", 18, 2)]
    b = sched.requests["b"]
    assert b.num_computed_tokens == 20 and b.output_token_ids == [7]
    assert step(sched)[0] == [("a", 7, 1), ("b", 20, 1)]
    drain(sched)
    assert_empty(sched)


def test_a_long_prompt_is_chunked_across_steps():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", 19, max_tokens=2))
    assert [step(sched)[0] for _ in range(4)] == [
        [("a", 0, 8)], [("a", 8, 8)], [("a", 16, 3)], [("a", 19, 1)],
    ]
    assert sched.requests == {} and sched.kv.num_free_blocks == 64


@pytest.mark.parametrize("long_prefill", [None, 8])
def test_a_short_request_starts_while_a_long_prompt_computes(long_prefill):
    sched = make_scheduler(budget=32, long_prefill=long_prefill)
    sched.add_request(make_request("long", 100, max_tokens=1))
    assert step(sched)[0] == [("long", 0, long_prefill or 32)]
    sched.add_request(make_request("short", 4, max_tokens=1))
    got = step(sched)[0]
    if long_prefill is None:  # the long prompt takes the whole budget: the short one waits
        assert got == [("long", 32, 32)]
    else:  # it takes at most 8 a step, and the short one starts (and finishes) beside it
        assert got == [("long", 8, 8), ("short", 0, 4)]
        assert "short" not in sched.requests
    drain(sched)
    assert_empty(sched)


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 3, max_tokens=2))
    assert step(sched)[0] == [("a", 0, 3), ("b", 0, 3)]
    assert [r.request_id for r in sched.waiting] == ["c"]
    # a and b finish on this step; c gets in on the next.
    assert step(sched)[0] == [("a", 3, 1), ("b", 3, 1)]
    assert step(sched)[0] == [("c", 0, 3)]
    drain(sched)
    assert_empty(sched)


def test_waiting_requests_are_served_first_come_first_served():
    sched = make_scheduler(num_blocks=4)
    sched.add_request(make_request("a", 12))  # 3 blocks
    sched.add_request(make_request("b", 8))  # 2 blocks: does not fit next to a
    sched.add_request(make_request("c", 3))  # 1 block: would fit, but b is first
    assert step(sched)[0] == [("a", 0, 12)]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_preemption_frees_the_newest_request_which_resumes_with_its_tokens():
    sched = make_scheduler(num_blocks=6, caching=False)
    sched.add_request(make_request("a", 8, max_tokens=12))
    sched.add_request(make_request("b", 8, max_tokens=12))
    a, b = sched.requests["a"], sched.requests["b"]
    assert step(sched)[0] == [("a", 0, 8), ("b", 0, 8)]  # blocks 0-1 and 2-3
    assert step(sched)[0] == [("a", 8, 1), ("b", 8, 1)]  # blocks 4 and 5: none left
    assert sched.kv.block_ids(a.request_id) == [0, 1, 4] and sched.kv.block_ids(b.request_id) == [2, 3, 5]
    for _ in range(3):
        got, out = step(sched)
        assert not out.preempted
    # Token 12 of a needs a fourth block: b, the newest, is preempted and freed.
    got, out = step(sched)
    assert out.preempted == ["b"] and got == [("a", 12, 1)]
    assert sched.kv.block_ids(a.request_id) == [0, 1, 4, 5]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert sched.kv.block_ids(b.request_id) == [] and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert b.output_token_ids == [7] * 5  # kept: it recomputes them
    # While a holds four blocks, b (13 tokens, four blocks) is not admitted.
    while not a.finished:
        got, out = step(sched)
        assert [g[0] for g in got] == ["a"]
    assert a.num_preemptions == 0 and "a" not in sched.requests
    # b resumes: prompt and generated tokens are recomputed in one go.
    assert step(sched)[0] == [("b", 0, 13)]
    assert b.status is RequestStatus.RUNNING and b.num_computed_tokens == 13
    drain(sched)
    assert b.num_output_tokens == 12 and b.finish_reason == "length"
    assert_empty(sched)


def test_a_request_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=2, caching=False)
    held = make_request("held", 4)
    held.num_computed_tokens = 4
    assert sched.reserve_remote(held)  # one block held by KV still arriving
    a = make_request("a", 4, max_tokens=4)
    sched.add_request(a)
    assert step(sched)[0] == [("a", 0, 4)]
    got, out = step(sched)  # a needs a second block; only a can give one up
    assert got == [] and out.preempted == ["a"] and a.num_preemptions == 1
    assert step(sched)[0] == []  # still no room
    sched.finish("held", RequestStatus.FINISHED_ABORTED)
    assert step(sched)[0] == [("a", 0, 5)]
    drain(sched)
    assert_empty(sched)


def test_preempted_requests_rejoin_the_queue_in_arrival_order():
    sched = make_scheduler(num_blocks=6, caching=False)
    for rid in "abc":
        sched.add_request(make_request(rid, 8, max_tokens=8))
    assert step(sched)[0] == [("a", 0, 8), ("b", 0, 8), ("c", 0, 8)]
    got, out = step(sched)  # a needs a third block: c, the newest, goes
    assert out.preempted == ["c"] and got == [("a", 8, 1), ("b", 8, 1)]
    for _ in range(3):
        assert not step(sched)[1].preempted
    got, out = step(sched)  # a needs a fourth block: b goes
    assert out.preempted == ["b"] and got == [("a", 12, 1)]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    drain(sched)
    assert_empty(sched)


def test_decodes_are_ordered_first():
    sched = make_scheduler(budget=6)
    sched.add_request(make_request("long", 20))
    sched.add_request(make_request("short", 1))
    assert step(sched)[0] == [("long", 0, 6)]
    # The budget is spent on long's chunks, short waits; then long's last
    # chunk leaves room for short.
    assert step(sched)[0] == [("long", 6, 6)]
    assert step(sched)[0] == [("long", 12, 6)]
    assert step(sched)[0] == [("short", 0, 1), ("long", 18, 2)]  # one-token prefill counts as a decode
    got, out = step(sched)
    assert got == [("long", 20, 1), ("short", 1, 1)] and out.num_decodes == 2


def test_all_blocks_are_free_after_finish_and_abort():
    sched = make_scheduler(num_blocks=16, budget=8)
    sched.add_request(make_request("run", 6, max_tokens=50))
    sched.add_request(make_request("chunk", 20, max_tokens=50))
    sched.add_request(make_request("wait", 30, max_tokens=50))
    step(sched)
    step(sched)
    assert sched.requests["chunk"].num_computed_tokens > 0
    assert sched.requests["wait"].status is RequestStatus.WAITING
    for rid in ("run", "chunk", "wait"):
        sched.finish(rid, RequestStatus.FINISHED_ABORTED)
    sched.finish("run", RequestStatus.FINISHED_ABORTED)  # twice is harmless
    assert not sched.has_unfinished()
    assert_empty(sched)


def test_finish_reasons():
    sched = make_scheduler()
    stop = make_request("stop", 4, max_tokens=5, stop_token_ids=[9])
    length = make_request("length", 4, max_tokens=2)
    sched.add_request(stop)
    sched.add_request(length)
    step(sched, token=5)
    step(sched, token=9)
    assert stop.finish_reason == "stop" and stop.stop_reason == 9
    assert length.finish_reason == "length" and length.output_token_ids == [5, 9]
    assert_empty(sched)


def test_min_tokens_holds_back_stop_tokens_and_max_model_len_ends():
    sched = make_scheduler(max_model_len=8)
    r = make_request("r", 4, max_tokens=4, min_tokens=2, stop_token_ids=[9])
    sched.add_request(r)
    step(sched, token=9)  # the first output token cannot stop the request
    assert not r.finished
    step(sched, token=9)
    assert r.finish_reason == "stop"
    s = make_request("s", 6, max_tokens=5)
    sched.add_request(s)
    drain(sched)
    assert s.finish_reason == "length" and s.num_tokens == 8 and s.num_output_tokens == 2


def test_remote_kv_reserves_blocks_and_decodes_after_arrival():
    sched = make_scheduler(num_blocks=8)
    r = make_request("r", 10)
    r.append_token(42)  # the prefill worker's first token
    r.num_computed_tokens = 10  # KV for the prompt comes from the prefill worker
    assert sched.reserve_remote(r)
    assert sched.kv.block_ids(r.request_id) == [0, 1, 2] and r.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert sched.num_waiting == 1 and not sched.has_unfinished()
    # Not published to the prefix cache while the KV is still arriving.
    assert all(b.block_hash is None for b in sched.kv.pool.blocks)
    assert step(sched)[0] == []
    sched.remote_kv_arrived("r")
    assert [sched.kv.pool.blocks[i].block_hash is not None for i in range(3)] == [True, True, False]
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.request_id, s.start, s.num_new_tokens, s.sample) == ("r", 10, 1, True)
    assert out.num_decodes == 1
    sched.update(out, ModelRunnerOutput({"r": 7}))
    assert sched.kv.block_ids(r.request_id) == [0, 1, 2] and r.output_token_ids == [42, 7]
    drain(sched)
    assert_empty(sched)


def test_queued_requests_give_up_their_blocks_when_nothing_else_can_run():
    """A preempted request at the head of the queue needs blocks that a
    request queued behind it holds (its KV arrived from a prefill worker):
    with nothing running, the engine stopped for good. Now the one behind
    gives them up and computes its KV again in its turn."""
    sched = make_scheduler(num_blocks=8, max_model_len=32)
    first = make_request("first", 12, max_tokens=18)
    first.num_computed_tokens = 12
    assert sched.reserve_remote(first)
    sched.start_remote("first", 5)
    for _ in range(8):
        step(sched)
    assert sched.kv.num_held("first") == 5
    second = make_request("second", 12, max_tokens=18)
    second.num_computed_tokens = 12
    assert sched.reserve_remote(second)
    sched.start_remote("second", 6)  # queued, holding its 3 blocks of KV
    drain(sched)
    assert first.num_output_tokens == second.num_output_tokens == 18
    assert second.num_preemptions == 1  # it gave up the KV that had arrived
    assert_empty(sched)


def test_forked_siblings_waiting_with_shared_blocks_do_not_stall_the_queue():
    """Requests at the context's limit, some n=2, on a cache of exactly one
    context: forked siblings wait holding shares of their prompt's blocks."""
    sched = make_scheduler(num_blocks=8, max_model_len=32)
    requests = [make_request(f"m{i}", 10 + i, max_tokens=22 - i, n=1 + i % 2)
                for i in range(6)]
    for r in requests:
        sched.add_request(r)
    drain(sched)
    assert all(r.num_output_tokens == 22 - i for i, r in enumerate(requests))
    assert_empty(sched)


def test_remote_reservation_fails_without_room_and_can_be_aborted():
    sched = make_scheduler(num_blocks=2)
    big = make_request("big", 12)
    big.num_computed_tokens = 12
    assert not sched.reserve_remote(big)
    assert sched.kv.num_free_blocks == 2 and sched.kv.block_ids(big.request_id) == [] and not sched.requests
    small = make_request("small", 5)
    small.num_computed_tokens = 5
    assert sched.reserve_remote(small)
    assert sched.kv.num_free_blocks == 0
    sched.finish("small", RequestStatus.FINISHED_ABORTED)
    assert_empty(sched)


def test_n_completions_fork_and_share_the_prompt_blocks():
    sched = make_scheduler(num_blocks=16)
    parent = make_request("p", 10, max_tokens=3, n=3)
    c1, c2 = parent.pending_children
    sched.add_request(parent)
    assert step(sched)[0] == [("p", 0, 10)]
    # After the parent's first token the children join, sharing blocks 0 and 1;
    # each computes the last prompt block itself.
    assert [r.request_id for r in sched.waiting] == ["p#1", "p#2"]
    assert sched.kv.block_ids(c1.request_id) == [0, 1] and c1.num_computed_tokens == 8
    assert step(sched)[0] == [("p", 10, 1), ("p#1", 8, 2), ("p#2", 8, 2)]
    assert sched.kv.block_ids(c1.request_id) == [0, 1, 3] and sched.kv.block_ids(c2.request_id) == [0, 1, 4] and sched.kv.block_ids(parent.request_id) == [0, 1, 2]
    pool = sched.kv.pool
    assert [pool.blocks[i].ref_cnt for i in range(5)] == [3, 3, 1, 1, 1]
    drain(sched)
    assert [r.num_output_tokens for r in (parent, c1, c2)] == [3, 3, 3]
    assert_empty(sched)


def test_aborting_a_parent_before_it_forks_drops_its_children():
    sched = make_scheduler()
    parent = make_request("p", 10, n=2)
    sched.add_request(parent)
    sched.finish("p", RequestStatus.FINISHED_ABORTED)
    assert parent.pending_children == [] and not sched.has_unfinished()
    assert_empty(sched)


def test_prefix_cache_hit_skips_the_cached_tokens():
    sched = make_scheduler()
    a = make_request("a", 10, max_tokens=1)
    sched.add_request(a)
    step(sched)
    b = Request("b", a.prompt_token_ids[:9] + [5, 5], SamplingParams(max_tokens=1))
    sched.add_request(b)
    got, out = step(sched)
    assert got == [("b", 8, 3)] and sched.kv.block_ids(b.request_id) == []  # finished after one token
    assert out.scheduled[0].end == b.num_computed_tokens == 11
    assert b.num_cached_tokens == 8
    assert_empty(sched)


def test_backlogged_when_a_whole_step_of_tokens_waits():
    sched = make_scheduler(num_blocks=256, budget=64)
    assert not sched.backlogged()
    sched.add_request(make_request("a", 40, max_tokens=4))
    assert not sched.backlogged()  # 40 tokens: less than a step
    sched.add_request(make_request("b", 24, max_tokens=4))
    assert sched.backlogged()  # 64: a whole step
    sched.add_request(make_request("c", 40, max_tokens=4))
    step(sched)  # a's 40, b's 24
    assert not sched.backlogged()  # a's and b's next token, c's 40
    sched.add_request(make_request("d", 30, max_tokens=4))
    assert sched.backlogged()  # and d's 30
    drain(sched)
    assert not sched.backlogged()
    assert_empty(sched)


def test_backlogged_for_a_share_of_a_step():
    sched = make_scheduler(num_blocks=256, budget=64)
    sched.add_request(make_request("a", 31, max_tokens=4))
    assert not sched.backlogged(0.5)  # 31 of the 32 tokens that make half a step
    sched.add_request(make_request("b", 1, max_tokens=4))
    assert sched.backlogged(0.5) and not sched.backlogged()
    for share in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="share"):
            sched.backlogged(share)
    drain(sched)
    assert_empty(sched)
