"""Random paged KV caches with shuffled block tables, for the kernel tests
(Triton's under the interpreter, and the CPU C kernels)."""

from __future__ import annotations

import math

import torch

POISON = 50.0  # fills every cache slot no sequence owns: reading one shows up


def make_paged(lens, block_size, num_kv_heads, head_dim, dtype, seed=0, spare_blocks=3):
    """Caches and shuffled block tables for sequences of the given lengths.

    Blocks are handed out in a random order, so no table is contiguous;
    rows are padded with 0 like the engine's, and slots that belong to no
    sequence hold POISON.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, POISON, dtype=dtype)
    v_cache = torch.full(shape, POISON, dtype=dtype)
    table = torch.zeros(len(lens), max(blocks_per_seq + [1]), dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=g)
    taken = 0
    for i, (n, nb) in enumerate(zip(lens, blocks_per_seq, strict=True)):
        table[i, :nb] = order[taken : taken + nb]
        taken += nb
        for pos in range(n):
            b, off = int(table[i, pos // block_size]), pos % block_size
            k_cache[b, off] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
            v_cache[b, off] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
    return k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


def randn(*shape, dtype, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
