"""The engine's dtype names (``engine.config.DTYPES``) as torch dtypes.

The names and their sizes are said once, in engine/config.py, which must stay
importable without torch (the gateway uses it); this is the one mapping of
those names to torch, for the modules that have torch anyway.
"""

from __future__ import annotations

import torch

from engine.config import DTYPE_SIZES, DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
assert all(TORCH_DTYPES[name].itemsize == size for name, size in DTYPE_SIZES.items())


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an engine dtype name; ValueError for any other name."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}") from None
