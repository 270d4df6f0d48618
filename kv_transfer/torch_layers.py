"""One request's KV sent over its pair's process group layer by layer,
while its prompt still computes: the torch transport's ``LayerSink``
(kv_transfer/layer_sink.py has the timeline and the bookkeeping).

As layer ``i`` of a step has stored its KV, the blocks that became final in
that layer are posted to the pair's frame channel: a frame announces them,
and the pair's thread reads them out of the cache and sends them while the
engine computes the next layer. A post still queued when the transfer
fails or is cancelled is dropped unread: its frame is never announced.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from engine.kv_blocks import KVBlockView
from kv_transfer.layer_sink import LayerSink
from kv_transfer.torch_frames import FrameChannel, payload_frame


class Cancelled(Exception):
    """A queued send of a closed sink: nothing was announced or sent."""


class LayerSends(LayerSink):
    def __init__(self, io: KVBlockView, request_id: str, attempt: int, num_blocks: int,
                 num_layers: int, span=None) -> None:
        super().__init__(num_blocks, num_layers, io.device, span)
        self.io = io
        self.request_id = request_id
        self.attempt = attempt
        self.channel: FrameChannel | None = None  # set before ``start``

    def _plan(self, layer: int, lo: int, hi: int) -> list[int]:
        return list(self._ids[lo:hi])

    def _submit(self, layer: int, lo: int, hi: int, src: list[int], event) -> Future:
        def read():
            if self.closed:  # the transfer failed or was cancelled: neither frame nor payload
                raise Cancelled(f"the layer sends of {self.request_id!r} were closed")
            if event is not None:  # on the pair's stream (torch_pair.py): no host wait
                torch.cuda.current_stream().wait_event(event)
            return self.io.read_layer(layer, src)

        def sent(nbytes: int, start: int) -> None:
            self.bytes_moved += nbytes
            self.landed[layer] = hi
            self._span("kv_transfer.layer_send", start, time.time_ns(), layer=layer,
                       blocks_upto=hi, bytes=nbytes)

        frame = payload_frame(self.request_id, self.attempt, layer, lo, hi - lo)
        return self.channel.post(frame, read, sent)
