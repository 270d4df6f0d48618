"""KV blocks of the paged cache as bytes on the wire, and the layout they travel in."""

from __future__ import annotations

import torch

from engine.loader.resolve import model_fingerprint
from kv_transfer.layout import KVLayout


def layout_of(engine) -> KVLayout:
    """The KV layout of an LLMEngine."""
    cfg = engine.model_config
    kv = engine.kv_cache_spec
    return KVLayout(
        model_fingerprint=model_fingerprint(engine.model_dir),
        dtype=engine.config.dtype,
        block_size=engine.config.cache.block_size,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        kv_cache_dtype=kv.name if kv.name != engine.config.dtype else "",
        kv_scales=kv.scales,
    )


def to_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor in its own dtype (bfloat16 included): no pickle."""
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def from_bytes(data: bytes, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s shape and dtype from ``to_bytes`` output."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(like.dtype).view(like.shape).to(like.device)
