"""The event loop a server process runs on: uvloop where it is installed
(as vLLM's and uvicorn's standard set-up), else asyncio's own.

Every streamed token crosses the gateway's and a worker's loops (a gRPC
read, an SSE write), and on a small host their CPU time is taken from the
engine's cores: with uvloop and httptools, three 64-request bursts of 64
tokens each cost the gateway's loop thread about a fifth less CPU
(docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger("rpc")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop when it can be imported."""
    try:
        import uvloop
    except ImportError:  # e.g. Windows, which uvloop does not support
        logger.debug("uvloop is not installed: running on asyncio's event loop")
        return asyncio.run(main)
    return uvloop.run(main)
