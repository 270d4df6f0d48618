"""Decode steps replayed from CUDA graphs.

A decode step of a small batch launches a handful of small kernels per layer,
and on a GPU the host's cost of launching them exceeds the kernels' own time.
Recording the whole forward pass once per padded batch size and replaying it
removes that cost: a step copies its inputs into static buffers, then
replays the graph of the smallest recorded size that holds the batch.

Padding rows are inert: their slot is -1 (store nothing) and they attend to a
single token of whatever block their stale block-table row names, so they
cost a little work, change no cache slot, and their outputs are dropped.
The decode kernel picks its number of context splits from the batch size and
an upper bound on the sequence length; the bound is fixed to
``max_model_len`` here, so a recorded launch suits every later step (the
splits past a short sequence's end are empty, which the kernel allows).

``capture=False`` runs the same padded, static-buffer path without recording
a graph: on the CPU that is how the tests check the padding and the buffers.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from engine.attention import AttentionMetadata

logger = logging.getLogger("engine")

MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then the multiples of 8, up to the first that holds
    ``max_batch`` (or MAX_GRAPH_BATCH, whichever is smaller)."""
    cap = min(max_batch, MAX_GRAPH_BATCH)
    sizes = []
    for size in [1, 2, 4, *range(8, MAX_GRAPH_BATCH + 1, 8)]:
        sizes.append(size)
        if size >= cap:
            break
    return sizes


class DecodeGraphs:
    """Static input buffers and, with ``capture``, one CUDA graph per padded
    batch size, all recorded into one memory pool (largest first, so the
    smaller graphs reuse its memory).

    Invariant: the KV cache tensors and the model's parameters keep their
    storage for the lifetime of this object (graphs hold raw addresses).
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_batch)
        n = self.sizes[-1]
        max_blocks = math.ceil(max_model_len / block_size)
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.int64)
            self.seq_lens = torch.ones(n, dtype=torch.int32)
            self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether this step can run here: decodes only, no more than the
        largest recorded batch."""
        return (
            meta.num_decode_seqs == meta.num_seqs
            and meta.num_seqs <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_seqs, hidden]
        bs = meta.num_seqs
        size = next(s for s in self.sizes if s >= bs)
        width = meta.block_tables.shape[1]
        self.input_ids[:bs].copy_(input_ids, non_blocking=True)
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.slot_mapping[:bs].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:bs].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:bs, :width].copy_(meta.block_tables, non_blocking=True)
        # Rows bs..size may hold an earlier step's inputs: make them inert.
        self.slot_mapping[bs:size].fill_(-1)
        self.seq_lens[bs:size].fill_(1)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:bs]
        graph.replay()
        return self.outputs[size][:bs]

    def _metadata(self, size: int) -> AttentionMetadata:
        # The *_cpu fields are what a graph-safe backend never reads; they
        # describe the padded shape honestly for anything that logs them.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.full((size,), self.max_model_len, dtype=torch.int32),
            num_decode_seqs=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size)
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        self.slot_mapping.fill_(-1)  # recording runs the model: store nothing
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles the kernels, settles the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)
