"""Layer-by-layer news of a prompt's KV, for transports that move it while
the prefill still computes (``LLMEngine.stream_layers``).

The model runs its layers in order; after layer ``i`` of a step has stored
the step's keys and values, block ``b`` of a watched request holds final KV
in layer ``i`` if every token of ``b`` is computed by the end of this step
(or ``b`` is the prompt's last, partial block and the step ends the prompt).
A sink hears, per step that schedules its request::

    begin_step(block_ids, num_final)   the first num_final blocks of the
                                       table are final once a layer has run
                                       (the table so far: a chunked prompt's
                                       grows chunk by chunk)
    layer_done(0) ... layer_done(L-1)  on the engine thread, as each layer's
                                       KV is stored (on a GPU: queued on the
                                       current stream; record an event)
    end_step()                         the step is over: every layer is done,
                                       also one whose layer_done was skipped
                                       (a step replayed from a CUDA graph)

and ``rewind()`` when its request was preempted: its blocks were freed and
the prompt is computed again into new ones, so what was sent is sent again.
The sink is dropped when its request finishes or is aborted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from engine.scheduler_output import SchedulerOutput


class LayerKVSink(Protocol):
    def begin_step(self, block_ids: list[int], num_final: int) -> None: ...

    def layer_done(self, layer: int) -> None: ...

    def end_step(self) -> None: ...

    def rewind(self) -> None: ...


class LayerStreams:
    """The sinks of one engine, by request id, and the hook that feeds them."""

    def __init__(self, scheduler, kv) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.sinks: dict[str, LayerKVSink] = {}

    def add(self, request_id: str, sink: LayerKVSink) -> None:
        self.sinks[request_id] = sink

    def drop(self, request_id: str) -> None:
        self.sinks.pop(request_id, None)

    def scheduled(self, sched: SchedulerOutput) -> None:
        """After each schedule: rewind the sinks of requests it preempted,
        drop those of requests that are gone."""
        if not self.sinks:
            return
        for request_id in sched.preempted:
            sink = self.sinks.get(request_id)
            if sink is not None:
                sink.rewind()
        requests = self.scheduler.requests
        for request_id in [r for r in self.sinks if r not in requests or requests[r].finished]:
            del self.sinks[request_id]

    @contextmanager
    def step(self, sched: SchedulerOutput, model) -> Iterator[None]:
        """Around one step's forward: installs ``model.on_layer_done`` while
        a watched request is scheduled, and ends the step for its sinks."""
        active = [(self.sinks[s.request_id], s) for s in sched.scheduled
                  if s.request_id in self.sinks] if self.sinks else []
        if not active:
            yield
            return
        sinks = []
        for sink, s in active:
            request = self.scheduler.requests[s.request_id]
            prompt = request.num_prompt_tokens
            if s.start >= prompt:
                continue  # past its prompt: nothing of it is news
            num_blocks = self.kv.num_blocks_for(prompt)
            final = num_blocks if s.end >= prompt else s.end // self.kv.block_size
            sink.begin_step(self.kv.block_ids(s.request_id)[:num_blocks], final)
            sinks.append(sink)

        def on_layer_done(layer: int) -> None:
            for sink in sinks:
                sink.layer_done(layer)

        model.on_layer_done = on_layer_done
        try:
            yield
        finally:
            model.on_layer_done = None
        for sink in sinks:
            sink.end_step()
