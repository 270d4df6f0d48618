"""LLMEngine.stream_layers: a sink hears, layer by layer inside each step,
which blocks of a prompt hold final KV. Checked against the cache itself:
a copy of each block taken when the sink is told it is final equals the
block once the prompt is done, chunked, prefix-cached and preempted alike."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import make_engine, tiny

from engine.sampling_params import SamplingParams

BS = 16


class CopyingSink:
    """A sink that copies each layer's final blocks as it is told of them
    (what a transport moving KV by layer reads), and logs the calls."""

    def __init__(self, engine) -> None:
        self.io = engine.kv_blocks
        self.calls: list[tuple] = []
        self.copies: dict[tuple[int, int], torch.Tensor] = {}  # (layer, index) -> [2, ...]
        self.sent: list[int] = []
        self.ids: list[int] = []
        self.final = 0

    def begin_step(self, block_ids, num_final):
        self.calls.append(("begin", num_final))
        self.ids, self.final = block_ids, num_final
        self.sent = self.sent or [0] * len(self.io.kv_caches)

    def layer_done(self, layer):
        self.calls.append(("layer", layer))
        lo, hi = self.sent[layer], self.final
        if hi > lo:
            data = self.io.read_layer(layer, self.ids[lo:hi])
            for j in range(lo, hi):
                self.copies[(layer, j)] = data[:, j - lo].clone()
            self.sent[layer] = hi

    def end_step(self):
        self.calls.append(("end",))

    def rewind(self):
        self.calls.append(("rewind",))
        self.sent = [0] * len(self.sent)

    def check_against(self, engine, request_id: str, num_blocks: int) -> None:
        ids = engine.kv_progress(request_id).block_ids
        assert len(ids) == num_blocks
        for layer in range(len(self.io.kv_caches)):
            final = self.io.read_layer(layer, ids)
            for j in range(num_blocks):
                assert torch.equal(self.copies[(layer, j)], final[:, j]), (layer, j)


@pytest.fixture(scope="module")
def model_dir():
    return tiny()[0]


def add(engine, rid, tokens, sink):
    engine.add_request(rid, tokens, SamplingParams(max_tokens=1, temperature=0),
                       hold_blocks=True)
    engine.stream_layers(rid, sink)


def run(engine):
    while engine.has_unfinished_requests():
        engine.step()


def test_a_chunked_prompt_is_streamed_layer_by_layer(model_dir):
    engine = make_engine(model_dir, block_size=BS, long_prefill_token_threshold=16,
                         max_num_batched_tokens=16)
    sink = CopyingSink(engine)
    add(engine, "a", list(range(3, 43)), sink)  # 40 tokens: 3 blocks, the last partial
    run(engine)
    step = [("layer", 0), ("layer", 1), ("end",)]
    assert sink.calls == [("begin", 1), *step, ("begin", 2), *step, ("begin", 3), *step]
    sink.check_against(engine, "a", 3)
    engine.release("a")
    assert engine.layer_streams.sinks == {}


def test_prompt_done_resolves_after_the_last_chunk_only(model_dir):
    """The one-batch mooncake sink: the future holds every block of the
    prompt, resolved in the step of its last chunk (not when a chunk's
    table happens to be all final)."""
    import asyncio

    from kv_transfer.progress import PromptDone

    engine = make_engine(model_dir, block_size=BS, long_prefill_token_threshold=32,
                         max_num_batched_tokens=32)
    loop = asyncio.new_event_loop()
    try:
        sink = PromptDone(loop, engine.kv_blocks.device, num_blocks=5)
        add(engine, "d", list(range(3, 75)), sink)  # 72 tokens: 5 blocks, 3 chunks
        engine.step()
        engine.step()
        loop.run_until_complete(asyncio.sleep(0))
        assert not sink.blocks.done()  # 4 of 5 blocks are in the table, all final
        engine.step()
        ids, event = loop.run_until_complete(sink.blocks)
        assert ids == engine.kv_progress("d").block_ids and len(ids) == 5 and event is None
    finally:
        loop.close()


def test_prefix_cached_blocks_are_final_at_the_first_step(model_dir):
    engine = make_engine(model_dir, block_size=BS)
    tokens = list(range(3, 40))
    engine.add_request("warm", tokens, SamplingParams(max_tokens=1))
    run(engine)
    sink = CopyingSink(engine)
    add(engine, "b", tokens + [7, 8], sink)  # its first 2 blocks are cache hits
    run(engine)
    assert sink.calls == [("begin", 3), ("layer", 0), ("layer", 1), ("end",)]
    sink.check_against(engine, "b", 3)


def test_a_preempted_prompt_is_streamed_again(model_dir):
    # 5 blocks for two 3-block prompts computed side by side: the newer one
    # is preempted when the older needs its third block, and starts over.
    engine = make_engine(model_dir, block_size=BS, num_blocks=5,
                         long_prefill_token_threshold=16, max_num_batched_tokens=32)
    first, second = CopyingSink(engine), CopyingSink(engine)
    add(engine, "a", list(range(3, 43)), first)
    add(engine, "b", list(range(50, 90)), second)
    for _ in range(3):
        engine.step()
    assert ("rewind",) in second.calls and ("rewind",) not in first.calls
    first.check_against(engine, "a", 3)
    engine.release("a")
    run(engine)
    second.check_against(engine, "b", 3)


def test_an_aborted_request_drops_its_sink_and_unknown_ids_are_refused(model_dir):
    engine = make_engine(model_dir, block_size=BS)
    sink = CopyingSink(engine)
    add(engine, "c", list(range(3, 43)), sink)
    engine.abort_request("c")
    assert engine.layer_streams.sinks == {}
    with pytest.raises(KeyError):
        engine.stream_layers("nobody", sink)
