"""One prefill/decode pair's two-rank torch.distributed process group
(gloo on CPU, NCCL on CUDA), as each end holds it. kv_transfer/torch_transport.py
opens them; kv_transfer/torch_frames.py orders what they carry."""

from __future__ import annotations

import asyncio
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
        return dist.ProcessGroupNCCL(store, rank, 2)
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

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.thread, self._guard, fn,
                                                                args)

    def submit(self, fn, *args):
        """Queue ``fn`` on the pair's thread without waiting (after whatever is queued)."""
        return self.thread.submit(self._guard, fn, args)

    def _guard(self, fn, args):
        try:
            return fn(*args)
        except BaseException:
            self.broken = True
            raise

    def send(self, t: torch.Tensor, peer: int, tag: int) -> None:
        self.group.send([_as_bytes(t)], peer, tag).wait()

    def recv(self, t: torch.Tensor, peer: int, tag: int) -> None:
        self.group.recv([_as_bytes(t)], peer, tag).wait()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.thread.shutdown(wait=False)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor (an fp8 KV cache's) as uint8, which every backend
    sends (gloo has no fp8 type); the same memory, so a receive lands in ``t``."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t
