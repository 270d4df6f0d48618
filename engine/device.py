"""Which device a tensor-parallel rank runs on, and making it current.

CUDA's current device is per thread, and Triton launches, graph capture and
NCCL use it; steps and KV copies run on worker threads, so each sets it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def rank_device(device: str, rank: int) -> str:
    """``cuda`` / ``cuda:N`` -> the GPU of ``rank`` (N + rank); the CPU is shared."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def on_device(device: torch.device) -> AbstractContextManager:
    """Make ``device`` the current CUDA device of this thread (nothing on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
