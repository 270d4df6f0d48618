"""Attention backends: one interface, a torch implementation and Triton kernels."""

from __future__ import annotations

from engine.attention.backend import AttentionBackend, AttentionMetadata


def get_attention_backend(name: str, device: str,
                          kv_scales: tuple[float, float] = (1.0, 1.0)) -> AttentionBackend:
    """``name`` is "auto", "torch" or "triton". "auto" picks Triton on CUDA and
    the torch reference elsewhere. ``kv_scales``: an 8-bit cache's (k, v) scales."""
    backend = _backend(name, device)
    backend.k_scale, backend.v_scale = kv_scales
    return backend


def _backend(name: str, device: str) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.startswith("cuda") else "torch"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'auto', 'torch' or 'triton'")


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
