"""KV blocks spread over tensor-parallel ranks, seen from rank 0 as one cache.

Each rank holds its own kv heads of every block. Reading a block asks every
rank for its heads and joins them along the head dimension; writing splits
the heads and hands each rank its share. So what leaves or enters a worker
is the whole-model block, whatever the tensor-parallel size on either side.
Same interface as ``engine.kv_blocks.KVBlocks``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.device import on_device
from engine.kv_blocks import KVBlocks
from engine.parallel.group import TensorParallel

_HEADS = -2  # [..., block_size, kv_heads, head_dim]


class ShardedKVBlocks:
    """``send`` hands the followers a command (``Followers.send``). Arguments
    are checked here, before any rank is involved: a follower that failed a
    command would leave the group waiting."""

    def __init__(self, local: KVBlocks, tp: TensorParallel,
                 send: Callable[[tuple], None]) -> None:
        self.local = local
        self.tp = tp
        self.send = send

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    def read(self, block_ids: list[int]) -> torch.Tensor:
        return self._read(block_ids, None)

    def read_layer(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        return self._read(block_ids, layer)

    def write(self, block_ids: list[int], data: torch.Tensor) -> None:
        self._write(block_ids, None, data)

    def write_layer(self, layer: int, block_ids: list[int], data: torch.Tensor) -> None:
        self._write(block_ids, layer, data)

    def empty(self, num_layers: int | None, num_blocks: int) -> torch.Tensor:
        k = self.local.kv_caches[0][0]
        return torch.empty(self._shape(num_layers, num_blocks), dtype=k.dtype, device=k.device)

    def _shape(self, num_layers: int | None, num_blocks: int) -> tuple[int, ...]:
        """Every rank's heads of ``num_blocks`` blocks (of every layer, or of one)."""
        _, block_size, heads, head_dim = self.local.kv_caches[0][0].shape
        shape = (2, num_blocks, block_size, heads * self.tp.size, head_dim)
        return shape if num_layers is None else (num_layers, *shape)


    def _check(self, block_ids: list[int], layer: int | None) -> list[int]:
        block_ids = [int(b) for b in block_ids]
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block ids {block_ids} are outside [0, {self.num_blocks})")
        if layer is not None and not 0 <= layer < len(self.local.kv_caches):
            raise ValueError(f"layer {layer} is outside [0, {len(self.local.kv_caches)})")
        return block_ids

    def _read(self, block_ids: list[int], layer: int | None) -> torch.Tensor:
        block_ids = self._check(block_ids, layer)
        with on_device(self.device), self.tp.command():
            self.send(("read_kv", block_ids, layer))
            parts = self.tp.gather(read_local(self.local, block_ids, layer))
        return torch.cat(parts, dim=_HEADS)

    def _write(self, block_ids: list[int], layer: int | None, data: torch.Tensor) -> None:
        block_ids = self._check(block_ids, layer)
        want = self._shape(None if layer is not None else len(self.local.kv_caches),
                           len(block_ids))
        if tuple(data.shape) != want or data.dtype != self.local.kv_caches[0][0].dtype:
            raise ValueError(f"KV data {tuple(data.shape)} {data.dtype} does not fit "
                             f"{tuple(want)} {self.local.kv_caches[0][0].dtype}")
        parts = list(data.to(self.device).chunk(self.tp.size, dim=_HEADS))
        with on_device(self.device), self.tp.command():
            self.send(("write_kv", block_ids, layer))
            mine = self.tp.scatter(torch.empty_like(parts[0], memory_format=torch.contiguous_format),
                                   parts)
            write_local(self.local, block_ids, layer, mine)


def read_local(blocks: KVBlocks, block_ids: list[int], layer: int | None) -> torch.Tensor:
    return blocks.read(block_ids) if layer is None else blocks.read_layer(layer, block_ids)


def write_local(blocks: KVBlocks, block_ids: list[int], layer: int | None,
                data: torch.Tensor) -> None:
    if layer is None:
        blocks.write(block_ids, data)
    else:
        blocks.write_layer(layer, block_ids, data)
