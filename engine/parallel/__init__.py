"""Tensor parallelism: one model split across processes by attention heads
and MLP columns, rank 0 scheduling and sampling for all of them."""

from engine.parallel.group import TensorParallel

__all__ = ["TensorParallel"]
