"""Tandem's public Python API.

    from tandem import LLM, SamplingParams
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams

if TYPE_CHECKING:
    from engine.outputs import CompletionOutput, RequestOutput
    from tandem.async_api import AsyncEngine
    from tandem.llm import LLM

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # Lazy, so `import tandem` (the CLI) does not load torch until needed.
    if name == "LLM":
        from tandem.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from tandem.async_api import AsyncEngine

        return AsyncEngine
    if name in ("RequestOutput", "CompletionOutput"):
        from engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
