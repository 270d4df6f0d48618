"""One prefill/decode pair's two-rank torch.distributed process group
(gloo on CPU, NCCL on CUDA), as each end holds it. kv_transfer/torch_transport.py
opens them; kv_transfer/torch_frames.py orders what they carry."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.openmp import serial_thread

TIMEOUT = datetime.timedelta(seconds=30)
PREFLIGHT_TAG = 0x7FFFFFFF  # first operation on a fresh pair: no transfer is in flight
# Every KV payload: the pair's KVFrames stream orders them (NCCL ignores tags).
PAYLOAD_TAG = 1


def make_group(store: dist.Store, rank: int, device: torch.device):
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT  # NOTE: or NCCL's watchdog waits its default minutes
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)


def join_group(store_address: str, group_name: str, device: torch.device):
    """The decode side of ``TorchSender._pair`` (blocking)."""
    host, port = store_address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)
    return make_group(dist.PrefixStore(group_name, store), 1, device)


@dataclass
class PairGroup:
    """One end of a prefill/decode pair's process group."""

    group: object
    name: str = ""  # the group's store prefix, unique to this pair's lifetime
    # Blocking send/recv calls run here, one at a time, in order.
    thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="kv-pair",
                                                   initializer=serial_thread)
    )
    broken: bool = False  # an operation failed (gloo has closed the pair) or its frames ended
    channel: object = None  # the sender's FrameChannel (kv_transfer/torch_frames.py)
    # On CUDA, the pair thread's own stream: reads, sends and receives there
    # neither wait for the engine's queued kernels nor hold them up.
    stream: object = None

    def __post_init__(self) -> None:
        nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds
        if nccl is not None and isinstance(self.group, nccl) and self.stream is None:
            self.stream = torch.cuda.Stream()

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.thread, self._guard, fn,
                                                                args)

    def submit(self, fn, *args):
        """Queue ``fn`` on the pair's thread without waiting (after whatever is queued)."""
        return self.thread.submit(self._guard, fn, args)

    def submit_local(self, fn, *args):
        """``submit`` for work that does not touch the group: its failure
        is its own, not the pair's."""
        return self.thread.submit(self._on_stream, fn, args)

    def _guard(self, fn, args):
        try:
            return self._on_stream(fn, args)
        except BaseException:
            self.broken = True
            raise

    def _on_stream(self, fn, args):
        if self.stream is None:
            return fn(*args)
        with torch.cuda.stream(self.stream):
            return fn(*args)

    def send(self, t: torch.Tensor, peer: int, tag: int) -> None:
        """Returns once ``t`` has left (on CUDA too, where NCCL's ``wait``
        only orders the stream): its memory may be reused then."""
        self.group.send([_as_bytes(t)], peer, tag).wait()
        if self.stream is not None:
            self.stream.synchronize()

    def recv(self, t: torch.Tensor, peer: int, tag: int) -> None:
        """Returns once ``t`` holds the bytes, for any stream to read."""
        self.group.recv([_as_bytes(t)], peer, tag).wait()
        if self.stream is not None:
            self.stream.synchronize()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.thread.shutdown(wait=False)
        if self.stream is not None:  # NCCL: its communicator is not freed otherwise
            with contextlib.suppress(Exception):
                self.group.shutdown()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor (an fp8 KV cache's) as uint8, which every backend
    sends (gloo has no fp8 type); the same memory, so a receive lands in ``t``."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t
