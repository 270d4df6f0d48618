"""The host tier's bytes (engine/host_kv_tier.py): ``num_slots`` whole KV
blocks, every layer and every rank's heads, in host memory (pinned when the
cache is on a GPU), copied to and from the device cache through its
``KVBlockView``."""

from __future__ import annotations

import logging
import os

import torch

from engine.host_kv_tier import HostKVTier
from engine.kv_blocks import KVBlockView

logger = logging.getLogger("engine")


def host_memory_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class HostKVStore:
    def __init__(self, blocks: KVBlockView, num_layers: int, num_slots: int) -> None:
        self.blocks = blocks
        like = blocks.empty(num_layers, 1)  # [layers, 2, 1, block_size, heads, dim]
        shape = (*like.shape[:2], num_slots, *like.shape[3:])
        wanted = like.numel() * like.element_size() * num_slots
        if wanted > host_memory_bytes() // 2:
            raise ValueError(
                f"the host KV tier would take {wanted / 2**30:.1f} GiB, more than half of this "
                f"machine's {host_memory_bytes() / 2**30:.1f} GiB of memory; "
                "lower host_kv_cache_gib"
            )
        self.data = torch.zeros(shape, dtype=like.dtype,
                                pin_memory=blocks.device.type == "cuda")

    def copy_out(self, device_block: int, slot: int) -> None:
        self.data[:, :, slot] = self.blocks.read([device_block])[:, :, 0].to("cpu")

    def copy_in(self, slot: int, device_block: int) -> None:
        self.blocks.write([device_block], self.data[:, :, slot : slot + 1].to(self.blocks.device))


def host_tier(gib: float, runner, num_layers: int, tp_size: int) -> HostKVTier | None:
    """The host tier of ``gib`` GiB under a runner's KV cache (``cache.
    host_kv_cache_gib``; None for 0), its bytes in a ``HostKVStore``."""
    if not gib:
        return None
    block_bytes = runner.block_bytes * tp_size
    slots = int(gib * 2**30) // block_bytes
    if slots < 1:
        raise ValueError(f"host_kv_cache_gib={gib} holds no KV block: one takes "
                         f"{block_bytes} bytes ({block_bytes / 2**30:.2g} GiB)")
    store = HostKVStore(runner.kv_blocks, num_layers, max(slots, 1))
    logger.info("host KV tier: %d blocks (%.2f GiB)", slots, slots * block_bytes / 2**30)
    return HostKVTier(slots, block_bytes, store.copy_out, store.copy_in)
