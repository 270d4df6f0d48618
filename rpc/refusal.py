"""Refusing a client-streaming call while its caller is still sending.

A stream-unary handler that fails on an early message answers with its status
while the caller is still writing. grpc.aio's client then races two things:
the status arriving, and its next write failing on the finished call. When
the write loses, the call ends INTERNAL ("Internal error from Core") and the
handler's status is gone (grpc issue 36066): a decode worker's NOT_FOUND for
an expired reservation reached the prefill worker as an internal error.

So a refusal is a short exchange, and no write ever meets a finished call:

- the server sends the initial metadata ``tandem-refused``, then reads and
  drops what the caller still sends until it half-closes (for at most
  ``DRAIN_S``), and only then answers with its status;
- the caller (``send_stream``), told so, stops sending and half-closes; the
  status then arrives intact.

A caller that does not take part still gets the status once it has sent all
it had (or, past ``DRAIN_S``, whatever the race gives, as before).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import grpc

logger = logging.getLogger("rpc")

REFUSED_KEY = "tandem-refused"

_END = object()

# How long a refusing handler waits for its caller to stop sending.
DRAIN_S = 10.0


async def refuse(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> None:
    """Server side, before a failing stream-unary handler answers: tell the
    caller to stop, then drop what it still sends until it half-closes."""
    try:
        await context.send_initial_metadata(((REFUSED_KEY, "1"),))
    except Exception:  # noqa: BLE001 -- already sent, or the call is gone: nothing to drain
        return
    try:
        async with asyncio.timeout(DRAIN_S):
            async for _ in requests:
                pass
    except TimeoutError:
        logger.warning("a refused caller went on sending for %.0f s", DRAIN_S)
    except Exception:  # noqa: BLE001 -- the caller went away: the status is moot
        logger.debug("draining a refused call", exc_info=True)


async def send_stream(method: Callable[..., Any], requests: AsyncIterable, **kwargs) -> Any:
    """Call the client-streaming ``method`` with ``requests``, and stop
    sending as soon as the server refuses the call, so that its status (an
    ``AioRpcError``) is the one raised."""
    refused = asyncio.Event()
    call = method(_until(requests, refused), **kwargs)

    async def watch() -> None:
        try:
            metadata = await call.initial_metadata()
        except Exception:  # noqa: BLE001 -- the call failed; awaiting it says how
            return
        if metadata is not None and REFUSED_KEY in dict(metadata):
            refused.set()

    watcher = asyncio.ensure_future(watch())
    try:
        return await call
    finally:
        watcher.cancel()


async def _until(requests: AsyncIterable, refused: asyncio.Event) -> AsyncIterator:
    """``requests`` until ``refused`` is set, even while the next one is
    still being made (a prefill chunk being computed)."""
    items = aiter(requests)

    async def next_item():
        return await anext(items, _END)

    stop = asyncio.ensure_future(refused.wait())
    try:
        while not refused.is_set():
            item = asyncio.ensure_future(next_item())
            await asyncio.wait((item, stop), return_when=asyncio.FIRST_COMPLETED)
            if not item.done():
                item.cancel()
                await asyncio.wait((item,))
                return
            value = item.result()
            if value is _END:
                return
            yield value
    finally:
        stop.cancel()
        close = getattr(items, "aclose", None)
        if close is not None:
            await close()
