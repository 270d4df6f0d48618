"""Whole KV blocks of one paged cache, copied out and in (KV transfer)."""

from __future__ import annotations

from typing import Protocol

import torch


class KVBlockView(Protocol):
    """Whole KV blocks of a worker's cache, every layer and every kv head,
    as KV transfer reads and writes them. ``KVBlocks`` is the view of one
    process's cache; ``engine.parallel.sharded_kv.ShardedKVBlocks`` the view
    over every tensor-parallel rank's."""

    @property
    def device(self) -> torch.device: ...

    @property
    def num_blocks(self) -> int: ...

    def read(self, block_ids: list[int]) -> torch.Tensor:
        """``[num_layers, 2, n, block_size, kv_heads, head_dim]``."""
        ...

    def read_layer(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """``[2, n, block_size, kv_heads, head_dim]``."""
        ...

    def write(self, block_ids: list[int], data: torch.Tensor) -> None: ...

    def write_layer(self, layer: int, block_ids: list[int], data: torch.Tensor) -> None: ...

    def empty(self, num_layers: int | None, num_blocks: int) -> torch.Tensor:
        """A buffer shaped like ``read`` (or ``read_layer`` without layers)."""
        ...


class KVBlocks:
    """Views one worker's KV cache (a list of per-layer ``(k, v)`` tensors)
    as blocks to copy out and in. Callers only touch blocks that no running
    request reads or writes: held by a finished prefill, or reserved and not
    yet started on a decode worker."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches

    @property
    def device(self) -> torch.device:
        return self.kv_caches[0][0].device

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0][0].shape[0]

    def read(self, block_ids: list[int]) -> torch.Tensor:
        """All layers: ``[num_layers, 2, n, block_size, kv_heads, head_dim]``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        out = self.empty(len(self.kv_caches), len(block_ids))
        # NOTE: gathered straight into one buffer: k[idx] then torch.stack
        # would copy every byte twice and allocate twice the payload.
        for layer, (k, v) in enumerate(self.kv_caches):
            torch.index_select(k, 0, idx, out=out[layer, 0])
            torch.index_select(v, 0, idx, out=out[layer, 1])
        return out

    def read_layer(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """One layer: ``[2, n, block_size, kv_heads, head_dim]``, contiguous."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        k, v = self.kv_caches[layer]
        out = self.empty(None, len(block_ids))
        torch.index_select(k, 0, idx, out=out[0])
        torch.index_select(v, 0, idx, out=out[1])
        return out

    def write(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            _put(k, idx, data[layer, 0])
            _put(v, idx, data[layer, 1])

    def write_layer(self, layer: int, block_ids: list[int], data: torch.Tensor) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        k, v = self.kv_caches[layer]
        _put(k, idx, data[0])
        _put(v, idx, data[1])

    def memory_regions(self) -> tuple[list[tuple[int, int]], int]:
        """The cache's memory for one-sided transports (RDMA-style engines
        register it and write blocks in place): ``(address, nbytes)`` of
        each layer's K then V tensor, and the bytes of one block in one of
        them. Block ``b`` of a region starts at ``address + b * block_nbytes``."""
        regions = []
        for k, v in self.kv_caches:
            for t in (k, v):
                if not t.is_contiguous():
                    raise ValueError("the KV cache is not contiguous: no memory regions")
                regions.append((t.data_ptr(), t.numel() * t.element_size()))
        k = self.kv_caches[0][0]
        return regions, k.stride(0) * k.element_size()

    def empty(self, num_layers: int | None, num_blocks: int) -> torch.Tensor:
        k = self.kv_caches[0][0]
        shape = (2, num_blocks, *k.shape[1:])
        if num_layers is not None:
            shape = (num_layers, *shape)
        return torch.empty(shape, dtype=k.dtype, device=k.device)


def _put(cache: torch.Tensor, idx: torch.Tensor, data: torch.Tensor) -> None:
    """``cache[idx] = data``. NOTE: index_copy_, not index_put: on a CPU whose
    cores are busy, a multi-threaded index_put of a few blocks took ~8 ms per
    call (its threads wait on each other), index_copy_ microseconds. One-byte
    (fp8) caches copy as uint8: index_copy_ has no fp8 kernel on the CPU."""
    if cache.element_size() == 1 and cache.dtype != torch.uint8:
        cache, data = cache.view(torch.uint8), data.view(torch.uint8)
    cache.index_copy_(0, idx, data.to(cache.device))
