"""A host-memory tier under the prefix cache: cached blocks evicted from the
device are kept in a bounded host pool, and a later prefix hit copies them
back instead of recomputing them (vLLM's KV offloading, SGLang's HiCache).

This is the tier's bookkeeping, with no tensors (the KV cache manager calls
it while scheduling): which digest sits in which host slot, least recently
used first out. The bytes move through two callables the engine supplies
(engine/host_kv_store.py): ``copy_out(device_block, slot)`` and
``copy_in(slot, device_block)``, both run at once, on the engine thread,
between two steps:

* a cached block is copied out when the pool hands it to a new owner
  (``BlockPool.allocate``), before anything can overwrite it;
* a host hit is copied into a freshly allocated device block, which is then
  published to the device prefix cache like a computed one.

A digest is kept with the bytes it was computed from (its preimage), so a
colliding digest is a miss here as on the device (engine/prefix_hash.py).
Preempted requests go through the same path: the scheduler frees their
blocks as published prefix-cache blocks, so blocks evicted while they wait
are kept here and copied back when they resume (a hit is always copied back:
one block's memcpy is far cheaper than computing its tokens); only the last,
partial block is recomputed. There is no separate swap space.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class HostKVTier:
    def __init__(self, num_slots: int, block_bytes: int,
                 copy_out: Callable[[int, int], None],
                 copy_in: Callable[[int, int], None]) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self._copy_out, self._copy_in = copy_out, copy_in
        # digest -> (slot, preimage), least recently used first.
        self._slots: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self.blocks_saved = 0  # device -> host copies
        self.blocks_restored = 0  # host -> device copies (prefix hits served from here)

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def bytes_moved(self) -> int:
        return (self.blocks_saved + self.blocks_restored) * self.block_bytes

    def save(self, device_block: int, block_hash: bytes, preimage: bytes) -> None:
        """Keep an evicted device block's bytes, dropping the least recently
        used host block when full. A digest kept already is only refreshed."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        if not self._free:
            _, (slot, _) = self._slots.popitem(last=False)
            self._free.append(slot)
        slot = self._free.pop()
        self._copy_out(device_block, slot)
        self._slots[block_hash] = (slot, preimage)
        self.blocks_saved += 1

    def contains(self, block_hash: bytes, preimage: bytes) -> bool:
        """Whether this block is kept; a hit becomes the most recently used,
        so that making room on the device for it cannot push it out."""
        entry = self._slots.get(block_hash)
        if entry is None or entry[1] != preimage:
            return False
        self._slots.move_to_end(block_hash)
        return True

    def restore(self, block_hash: bytes, device_block: int) -> None:
        """Copy a kept block (``contains`` said so) into ``device_block``."""
        slot, _ = self._slots[block_hash]
        self._slots.move_to_end(block_hash)
        self._copy_in(slot, device_block)
        self.blocks_restored += 1

    def clear(self) -> None:
        """Forget every kept block (their device originals may be garbage)."""
        self._free.extend(slot for slot, _ in self._slots.values())
        self._slots.clear()
