"""Drive a request stream through a client on its arrival schedule."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tqdm import tqdm

from tandem.bench.clients import Client
from tandem.bench.datasets import BenchRequest
from tandem.bench.metrics import RequestRecord


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # first request sent -> last response ended


async def run_stream(client: Client, requests: list[BenchRequest], offsets: list[float],
                     max_concurrency: int | None = None, progress: bool = True,
                     desc: str = "requests") -> RunResult:
    """Send request i at ``offsets[i]`` seconds (later if ``max_concurrency``
    requests are already in flight); wait for every response."""
    if len(offsets) != len(requests):
        raise ValueError("one arrival offset per request")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {max_concurrency}")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, leave=False)
    start = time.perf_counter()

    async def one(request: BenchRequest, at: float) -> RequestRecord:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            record = await client.send(request)
        else:
            async with limit:
                record = await client.send(request)
        bar.update(1)
        return record

    try:
        records = await asyncio.gather(*(one(r, t) for r, t in zip(requests, offsets)))
    finally:
        bar.close()
    end = max((r.end for r in records), default=start)
    return RunResult(list(records), max(end - start, 1e-9))


async def send_sequentially(client: Client, requests: list[BenchRequest]
                            ) -> list[RequestRecord]:
    """One at a time: warm-up and the correctness gate."""
    return [await client.send(r) for r in requests]
