"""The host tier's bytes (engine/host_kv_tier.py): ``num_slots`` whole KV
blocks, every layer and every rank's heads, in host memory (pinned when the
cache is on a GPU), copied to and from the device cache through its
``KVBlockView``."""

from __future__ import annotations

import os

import torch

from engine.kv_blocks import KVBlockView


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
