"""The padded, static-buffer decode path that CUDA graphs replay, run here
without recording (``capture=False``) on the Triton backend under the CPU
interpreter. The recorded graphs themselves are checked in test_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch
from engine_fixtures import assert_all_free
from tiny_models import build_tiny_model

from engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tandem import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path, _ = build_tiny_model("llama-gqa", tmp_path_factory.mktemp("graphs"))
    return str(path)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 4]
    assert graph_batch_sizes(9) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert graph_batch_sizes(10_000)[-1] == 256


def _padded_llm(tiny_dir: str) -> tuple[LLM, list[int]]:
    """An engine on the Triton backend whose decode steps go through the
    padded static buffers; returns it and the list of batch sizes run."""
    llm = LLM(tiny_dir, dtype="float32", block_size=4, num_blocks=96, max_num_batched_tokens=64,
              attention_backend="triton", max_model_len=64)
    runner = llm.engine.runner
    assert runner.decode_graphs is None  # the CPU runs eagerly by default
    graphs = DecodeGraphs(runner.model, runner.kv_caches, max_batch=8, max_model_len=64,
                          block_size=4, device=runner.device, capture=False)
    batches: list[int] = []
    run = graphs.run

    def counting_run(input_ids, positions, meta):
        batches.append(meta.num_seqs)
        return run(input_ids, positions, meta)

    graphs.run = counting_run
    runner.decode_graphs = graphs
    return llm, batches


def test_padded_decode_matches_eager(tiny_dir):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 9, 14, 5, 21)]
    # Different lengths, so the batch shrinks 5 -> 4 -> 3 -> 1 and padding
    # rows hold earlier steps' inputs.
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (3, 9, 5, 12, 7)]
    eager = LLM(tiny_dir, dtype="float32", block_size=4, num_blocks=96, max_num_batched_tokens=64,
                attention_backend="triton", max_model_len=64)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]

    llm, batches = _padded_llm(tiny_dir)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert {5, 4, 3, 1} <= set(batches)  # 5 and 3 ran padded to 8 and 4
    assert_all_free(llm.engine)


def test_padding_rows_store_nothing(tiny_dir):
    llm, _ = _padded_llm(tiny_dir)
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    # Four decodes, then three: padded to four, row 3 keeps the first step's slot 9.
    from engine.attention import AttentionMetadata

    def meta(slots, lens):
        n = len(slots)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(n + 1).int(),
            seq_lens=torch.tensor(lens).int(), block_tables=torch.tensor([[0, 1, 2]] * n).int(),
            query_start_loc_cpu=torch.arange(n + 1).int(), seq_lens_cpu=torch.tensor(lens).int(),
            num_decode_seqs=n, max_query_len=1, max_seq_len=max(lens),
        )

    with torch.inference_mode():
        ids = torch.tensor([5, 6, 7, 8])
        graphs.run(ids, torch.tensor([0, 1, 8, 9]), meta([0, 1, 8, 9], [1, 2, 9, 10]))
        # A sentinel in slot 9 of every layer: a padding row that stored its
        # stale token again would overwrite it.
        slot9 = [(k.view(-1, *k.shape[2:])[9], v.view(-1, *v.shape[2:])[9])
                 for k, v in runner.kv_caches]
        for k, v in slot9:
            k.fill_(7.0)
            v.fill_(7.0)
        out = graphs.run(ids[:3] + 1, torch.tensor([1, 2, 3]), meta([1, 2, 3], [2, 3, 4]))
    assert out.shape[0] == 3
    assert all((k == 7.0).all() and (v == 7.0).all() for k, v in slot9)


def test_only_pure_decode_steps_fit(tiny_dir):
    llm, batches = _padded_llm(tiny_dir)
    # One prompt: its prefill step is not a decode step and runs eagerly.
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    assert batches == [1, 1, 1]  # the three decode steps after the prefill
