"""Which device a tensor-parallel rank runs on, and claiming it.

CUDA's current device is per thread, and Triton launches, graph capture and
NCCL use it; steps and KV copies run on worker threads, so each sets it.
On the CPU the ranks share the cores instead.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext

import torch

from engine.cpu_malloc import keep_freed_memory


def rank_device(device: str, rank: int) -> str:
    """``cuda`` / ``cuda:N`` -> the GPU of ``rank`` (N + rank); the CPU is shared."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def on_device(device: torch.device) -> AbstractContextManager:
    """Make ``device`` the current CUDA device of this thread (nothing on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def comm_backend(device: str) -> str:
    """The torch.distributed backend of a tensor-parallel group on ``device``."""
    return "nccl" if device.startswith("cuda") else "gloo"


def claim_device(device: str, tp_size: int) -> None:
    """Set this process up to run one of ``tp_size`` ranks on ``device``: its
    GPU current on CUDA; on the CPU, with several ranks, an equal share of
    the cores (each rank running a full pool of threads oversubscribes the
    machine, and the ranks then wait on each other at every all-reduce), and
    malloc keeping the memory each step frees (cpu_malloc.py)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        return
    keep_freed_memory()
    if tp_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
