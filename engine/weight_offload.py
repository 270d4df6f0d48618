"""``cpu_offload_gb``: decoder layers whose weights live in pinned host memory
and are copied to the accelerator for each forward.

Whole decoder layers are offloaded, first to last, until their parameters
add up to at least ``cpu_offload_gb`` GB (10**9 bytes). Each offloaded layer
gets a forward pre-hook that points its parameters at device copies, and a
forward hook that points them back at the host ones, so the device holds at
most two offloaded layers' weights at a time: the one computing and the next
one, whose copy was started on a side stream when this one began (it overlaps
with this layer's compute; the compute stream waits for it before using it).
Buffers (rotary tables) stay on the device.

The host copies are pinned (page-locked) so that the copies are asynchronous
DMA. With ``pin=False`` (the CPU device in tests, where there is nothing to
pin for) the mechanism runs the same, synchronously.

Invariants: between forwards every offloaded parameter is its host tensor;
``bytes_offloaded`` is what the device no longer holds. CUDA graphs are not
used with offload (the runner checks ``EngineConfig.cpu_offload_gb``): a
replayed graph would read the last forward's device copies, freed since.
"""

from __future__ import annotations

import torch
from torch import nn

GB = 10**9


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class WeightOffload:
    def __init__(self, layers: list[nn.Module], offload_gb: float, device: torch.device,
                 pin: bool = True) -> None:
        total = sum(param_bytes(layer) for layer in layers)
        want = int(offload_gb * GB)
        if want > total:
            raise ValueError(
                f"cpu_offload_gb={offload_gb} asks to offload {want} bytes, but the decoder "
                f"layers hold only {total} bytes of weights; lower cpu_offload_gb"
            )
        self.device = device
        self.layers: list[nn.Module] = []
        self.host: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        self.bytes_offloaded = 0
        for layer in layers:
            if self.bytes_offloaded >= want:
                break
            self._offload(layer, pin)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Layer index -> (device tensors, event when their copy is done), started early.
        self._prefetched: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _offload(self, layer: nn.Module, pin: bool) -> None:
        i = len(self.layers)
        pairs = []
        for p in layer.parameters():
            host = p.data.to("cpu")
            if pin:
                host = host.pin_memory()
            pairs.append((p, host))
            self.bytes_offloaded += p.numel() * p.element_size()
            p.data = host
        self.layers.append(layer)
        self.host[i] = pairs
        layer.register_forward_pre_hook(lambda _m, _args, i=i: self._fetch(i))
        layer.register_forward_hook(lambda _m, _args, _out, i=i: self._release(i))

    def _copy(self, i: int) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Start copying layer ``i``'s weights to the device (on the side stream)."""
        if self.stream is None:
            return [h.to(self.device) for _, h in self.host[i]], None
        with torch.cuda.stream(self.stream):
            tensors = [h.to(self.device, non_blocking=True) for _, h in self.host[i]]
            event = torch.cuda.Event()
            event.record(self.stream)
        return tensors, event

    def _fetch(self, i: int) -> None:
        tensors, event = self._prefetched.pop(i, None) or self._copy(i)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in tensors:  # allocated on the side stream, used and freed on this one
                t.record_stream(current)
        for (p, _), t in zip(self.host[i], tensors, strict=True):
            p.data = t
        if i + 1 < len(self.layers) and i + 1 not in self._prefetched:
            self._prefetched[i + 1] = self._copy(i + 1)

    def _release(self, i: int) -> None:
        for p, host in self.host[i]:
            p.data = host
