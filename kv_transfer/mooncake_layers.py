"""One request's KV written into a decode worker's blocks layer by layer,
while its prompt still computes: the mooncake transport's ``LayerSink``
(kv_transfer/layer_sink.py has the timeline and the bookkeeping).

As layer ``i`` of a step has stored its KV, the blocks that became final in
that layer are planned as segments on the engine thread and written by the
endpoint's writer thread. A write queued before the transfer failed or was
cancelled returns without writing.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from kv_transfer.layer_sink import LayerSink
from kv_transfer.mooncake_endpoint import MooncakeEndpoint, Run, Segments
from rpc.protos import worker_pb2


class LayerWrites(LayerSink):
    def __init__(self, endpoint: MooncakeEndpoint, target: worker_pb2.MooncakeTarget,
                 dst_block_ids: list[int], num_layers: int, span=None) -> None:
        endpoint.check_target(target)
        super().__init__(len(dst_block_ids), num_layers, endpoint.device, span)
        self.endpoint = endpoint
        self.target = target
        self.dst = list(dst_block_ids)
        self.num_segments = 0
        self._runs: dict[tuple[int, int], list[Run]] = {}  # this step's (lo, hi) -> runs

    def _prepare_step(self) -> None:
        self._runs = {}

    def _plan(self, layer: int, lo: int, hi: int) -> Segments:
        """Segments of blocks [lo, hi) in ``layer``; their runs are found once a step."""
        runs = self._runs.get((lo, hi))
        if runs is None:
            runs = self._runs[(lo, hi)] = self.endpoint.runs(self._ids[lo:hi], self.dst[lo:hi])
        return self.endpoint.place(self.target, runs, range(layer, layer + 1))

    def _submit(self, layer: int, lo: int, hi: int, segments: Segments, event) -> Future:
        return self.endpoint.thread.submit(self._write, layer, hi, segments, event)

    # ---- the writer thread --------------------------------------------------------------

    def _write(self, layer: int, upto: int, segments: Segments, event) -> None:
        if self.closed:
            return
        if event is not None:
            event.synchronize()
        start = time.time_ns()
        self.endpoint.write(self.target.rpc_address, *segments)
        nbytes = sum(segments[2])
        self.bytes_moved += nbytes
        self.num_segments += len(segments[2])
        self.landed[layer] = upto
        self._span("kv_transfer.layer_write", start, time.time_ns(), layer=layer,
                   blocks_upto=upto, bytes=nbytes, segments=len(segments[2]))
