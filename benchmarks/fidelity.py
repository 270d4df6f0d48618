"""What the fidelity benchmarks (8-bit weights, fp8 KV) share: a fixed set
of prompts, and how many leading greedy tokens two runs agree on."""

from __future__ import annotations

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colors:",
    "Explain photosynthesis to a child in two sentences.",
    "Translate to French: The weather is nice today.",
    "Write a haiku about autumn leaves.",
    "What is 17 times 23? Think step by step.",
]


def leading_matches(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share before they first differ."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
