"""``tandem.AsyncEngine``: the asyncio engine, built from vLLM-style arguments."""

from __future__ import annotations

from typing import Any

from engine.async_engine import AsyncEngineLoop
from engine.llm_engine import LLMEngine
from tandem.llm import engine_config


class AsyncEngine(AsyncEngineLoop):
    """``async for out in engine.generate(prompt, params, request_id)``."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        config = engine_config(model, **kwargs)
        # Built on the engine thread, which steps it (see AsyncEngineLoop).
        super().__init__(lambda: LLMEngine(config))
