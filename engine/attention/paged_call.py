"""How Python calls the C attention kernels that read a paged cache in place.

cpu_attention.py's kernel and the prefill tile kernels (amx_prefill.py,
f32_prefill.py) take the same leading arguments: the output and the query
with their token and head strides, the two caches with three strides, the
block tables with their row stride, ``query_start_loc`` and ``seq_lens`` as
int32 on the host. The tile kernels also share the rest of their signature,
what they serve, and their Python entry points (``TileKernel``).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from engine.attention import cbuild

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

# out, os0, os1, query, qs0, qs1, k_cache, v_cache, cs0, cs1, cs2, tables, bts0, qsl, lens
ARGTYPES = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64,
            _PTR, _PTR]
# ... then num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, min_query_len
TILE_ARGTYPES = [*ARGTYPES, _INT, _INT, _INT, _INT, _INT, ctypes.c_float, _INT]


def host_tables(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block tables, ``query_start_loc`` and ``seq_lens`` as the kernels
    read them: contiguous int32 (keep them alive for the call)."""
    tables = block_tables.to(torch.int32).contiguous()
    qsl = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    num_seqs = lens.shape[0]
    if qsl.shape[0] != num_seqs + 1 or tables.shape[0] != num_seqs:
        raise ValueError("query_start_loc needs num_seqs + 1 entries and block_tables num_seqs rows")
    return tables, qsl, lens


def check_caches_and_out(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         out: torch.Tensor) -> None:
    """ValueError unless both caches share a layout and dtype and ``out``
    matches the query with a unit last stride."""
    if v_cache.stride() != k_cache.stride() or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same layout and dtype")
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} with unit last stride")


def leading_args(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, tables: torch.Tensor, qsl: torch.Tensor,
                 lens: torch.Tensor) -> list:
    """The arguments of ``ARGTYPES``, in order."""
    return [out.data_ptr(), out.stride(0), out.stride(1), query.data_ptr(), query.stride(0),
            query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.stride()[:3],
            tables.data_ptr(), tables.stride(0), qsl.data_ptr(), lens.data_ptr()]


class TileKernel:
    """A prefill tile kernel: C ``source`` whose function ``symbol`` takes
    ``TILE_ARGTYPES``, computing in ``dtype``; ``ready(lib)`` says whether the
    built library runs on this CPU. Its module exposes ``available``,
    ``supports`` and ``prefill``."""

    def __init__(self, symbol: str, source: str, dtype: torch.dtype,
                 ready: Callable[[ctypes.CDLL], bool]) -> None:
        self.symbol, self.source, self.dtype, self.ready = symbol, source, dtype, ready

    @functools.cached_property
    def _fn(self):
        lib = cbuild.load(self.symbol, self.source)
        if lib is None or not self.ready(lib):
            return None
        fn = getattr(lib, self.symbol)
        fn.restype = ctypes.c_int
        fn.argtypes = TILE_ARGTYPES
        return fn

    def available(self) -> bool:
        """Whether this CPU and compiler run the kernel."""
        return self._fn is not None

    def supports(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether ``prefill`` serves these tensors: the kernel's dtype on the
        CPU, head size a multiple of 32 up to 256, at most 16 query heads per
        kv head, and the kernel built here."""
        heads, dim = query.shape[1:]
        kv_heads = k_cache.shape[2]
        return (query.device.type == "cpu" and query.dtype == self.dtype
                and k_cache.dtype == self.dtype and query.stride(-1) == 1
                and k_cache.stride(-1) == 1 and dim % 32 == 0 and dim <= 256
                and heads % kv_heads == 0 and heads // kv_heads <= 16 and self.available())

    def prefill(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
        query_start_loc: torch.Tensor,  # [num_seqs + 1] int, on the host
        seq_lens: torch.Tensor,  # [num_seqs] int, on the host
        scale: float,
        out: torch.Tensor,
        min_query_len: int = 1,
    ) -> None:
        """Causal attention of the sequences with at least ``min_query_len``
        new tokens, written to their rows of ``out`` (the others' rows are
        left as they were). Check ``supports`` first; the new tokens' keys and
        values must already be in the cache."""
        _, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        check_caches_and_out(query, k_cache, v_cache, out)
        tables, qsl, lens = host_tables(block_tables, query_start_loc, seq_lens)
        rc = self._fn(*leading_args(out, query, k_cache, v_cache, tables, qsl, lens),
                      lens.shape[0], num_heads, num_kv_heads, head_dim, block_size, scale,
                      min_query_len)
        if rc != 0:
            raise ValueError(f"{self.symbol} cannot serve {num_heads} heads, {num_kv_heads} kv "
                             f"heads, head_dim {head_dim}")
