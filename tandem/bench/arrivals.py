"""When each request is sent, as offsets in seconds from the start.

Poisson arrivals at ``rate`` requests/s have exponential gaps; ``burstiness``
generalises them to gamma gaps with shape ``burstiness`` and the same mean
``1 / rate`` (vLLM's definition): 1 is Poisson, below 1 burstier, above 1
more regular. An infinite rate sends everything at once.
"""

from __future__ import annotations

import math
import random


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """The first request goes at 0; request i after i gaps."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive (inf: all at once), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)  # mean gap = shape * scale = 1 / rate
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.gammavariate(burstiness, scale)
    return offsets


def parse_rates(spec: str) -> list[float]:
    """``"1,2,inf"`` -> ``[1.0, 2.0, inf]``."""
    try:
        rates = [float(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"request rates must be numbers or 'inf', got {spec!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"request rates must be positive, got {spec!r}")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"
