"""Real worker processes on loopback, and the test's own "gateway".

The worker tests start prefill, decode and colocated ("both") workers as
separate processes with ``tandem.cluster.LocalCluster`` and drive them over
gRPC with the generated ``Worker`` stub, playing the gateway's part:
Reserve on a decode worker, Prefill with the ticket, then Decode.

Plain functions and classes rather than conftest fixtures (tests/conftest.py
is shared): a test module wraps them in the fixtures it wants.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from engine.sampling_params import SamplingParams
from rpc.convert import params_to_proto
from rpc.pool import ChannelPool
from rpc.protos import common_pb2, worker_pb2, worker_pb2_grpc
from tandem.cluster import LocalCluster, Proc


def worker_args(model_dir: Path | str, num_blocks: int, *extra: str) -> list[str]:
    # float32 unless asked: tests compare workers' tokens with the offline engine's.
    dtype = [] if "--dtype" in extra else ["--dtype", "float32"]
    return ["--model", str(model_dir), "--num-blocks", str(num_blocks), "--grace", "5", *dtype,
            *extra]


@dataclass
class Worker:
    """One started worker process and where to reach it."""

    proc: Proc
    num_blocks: int
    metrics_port: int | None = None

    @property
    def address(self) -> str:
        return self.proc.address

    @property
    def worker_id(self) -> str:
        return self.proc.worker_id


def start_worker(cluster: LocalCluster, role: str, model_dir: Path | str, num_blocks: int,
                 *extra: str, metrics: bool = False) -> Worker:
    return start_worker_set(cluster, [(role, extra)], model_dir, num_blocks, metrics=metrics)[0]


def start_worker_set(cluster: LocalCluster, specs: list[tuple[str, tuple[str, ...]]],
                     model_dir: Path | str, num_blocks: int, metrics: bool = False,
                     ) -> list[Worker]:
    """One worker per ``(role, extra flags)``, all started at once: their
    start-ups (imports, model load, warm-up) overlap."""
    # NOTE: port 0, and the worker names the port it got: a port picked here
    # and bound there could be taken in between.
    cmds = [(role, [*worker_args(model_dir, num_blocks, *extra),
                    *(["--metrics-port", "0"] if metrics else [])]) for role, extra in specs]
    return [Worker(proc, num_blocks, int(proc.extra["metrics"].rsplit(":", 1)[1])
                   if metrics else None)
            for proc in cluster.start_all(cmds)]


def refused_start(*flags: str) -> str:
    """A decode worker started with ``flags`` that argparse refuses (exit
    code 2, before any model loads): what it said on stderr."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "decode_service", *flags],
                         capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 2, out.stderr
    return out.stderr


def params(**kw) -> common_pb2.SamplingParams:
    return params_to_proto(SamplingParams(**kw))


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    chunks: int = 0


class Gateway:
    """What the gateway does with workers, over real gRPC. Create one per
    test: its channels belong to the test's event loop."""

    def __init__(self) -> None:
        self.channels = ChannelPool()

    async def __aenter__(self) -> Gateway:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channels.close()

    def stub(self, w: Worker | str) -> worker_pb2_grpc.WorkerStub:
        address = w if isinstance(w, str) else w.address
        return worker_pb2_grpc.WorkerStub(self.channels.get(address))

    async def info(self, w: Worker) -> worker_pb2.InfoResponse:
        return await self.stub(w).Info(worker_pb2.InfoRequest(), timeout=10)

    async def reserve(self, decode: Worker, request_id: str, prompt: list[int],
                      p: common_pb2.SamplingParams, lease_ms: int = 0,
                      attempt: int = 0) -> worker_pb2.Ticket:
        reply = await self.stub(decode).Reserve(worker_pb2.ReserveRequest(
            request_id=request_id, prompt_token_ids=prompt, params=p, lease_ms=lease_ms,
            attempt=attempt,
        ), timeout=30)
        return reply.ticket

    async def prefill(self, prefill: Worker, request_id: str, prompt: list[int],
                      p: common_pb2.SamplingParams, ticket: worker_pb2.Ticket,
                      transport: str = "grpc") -> worker_pb2.PrefillResponse:
        return await self.stub(prefill).Prefill(worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, params=p, ticket=ticket,
            transport=transport,
        ), timeout=60)

    async def decode(self, w: Worker, request_id: str, p: common_pb2.SamplingParams,
                     first: worker_pb2.PrefillResponse | None = None,
                     prompt: list[int] | None = None, attempt: int = 0,
                     migrated: list[int] | None = None,
                     first_token_sent: bool = False) -> Completion:
        """``migrated``: tokens already sent (a migration recomputes them).
        ``first_token_sent``: as the gateway does, the stream leaves out
        ``first``'s token (the caller has it from the PrefillResponse);
        otherwise the decode worker streams it too."""
        req = worker_pb2.DecodeRequest(request_id=request_id, params=p, attempt=attempt,
                                       prompt_token_ids=prompt or [],
                                       output_token_ids=migrated or [],
                                       first_token_sent=first_token_sent)
        out = Completion()
        if first is not None:
            req.first_token_id = first.first_token_id
            if first.HasField("first_logprobs"):
                req.first_logprobs.CopyFrom(first.first_logprobs)
        async for chunk in self.stub(w).Decode(req, timeout=60):
            out.token_ids.extend(chunk.token_ids)
            out.finish_reason = chunk.finish_reason or out.finish_reason
            out.chunks += 1
        return out

    async def disaggregated(self, prefill: Worker, decode: Worker, request_id: str,
                            prompt: list[int], p: common_pb2.SamplingParams,
                            transport: str = "grpc") -> Completion:
        """Reserve -> Prefill -> Decode, the gateway's happy path."""
        ticket = await self.reserve(decode, request_id, prompt, p)
        first = await self.prefill(prefill, request_id, prompt, p, ticket, transport)
        return await self.decode(decode, request_id, p, first=first)

    async def colocated(self, both: Worker, request_id: str, prompt: list[int],
                        p: common_pb2.SamplingParams) -> Completion:
        return await self.decode(both, request_id, p, prompt=prompt)

    async def abort(self, w: Worker, request_id: str) -> bool:
        return (await self.stub(w).Abort(worker_pb2.AbortRequest(request_id=request_id),
                                         timeout=10)).found

    async def wait_in_transfer(self, prefill: Worker, timeout: float = 20.0) -> None:
        """Until ``prefill`` has computed a prompt and holds its blocks for a
        transfer: blocks in use, nothing running or waiting."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            i = await self.info(prefill)
            if i.free_blocks < i.num_blocks and not i.num_running and not i.num_waiting:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the prefill worker never reached the transfer")

    async def prefill_into_a_killed_worker(self, prefill: Worker, victim: Worker,
                                           request_id: str, prompt: list[int],
                                           p: common_pb2.SamplingParams,
                                           transport: str) -> grpc.aio.AioRpcError:
        """Reserve on ``victim`` and stop it; prefill for it on ``prefill``,
        and kill ``victim`` once that waits in the transfer. The status the
        prefill call failed with."""
        ticket = await self.reserve(victim, request_id, prompt, p)
        victim.proc.popen.send_signal(signal.SIGSTOP)
        call = asyncio.ensure_future(self.prefill(prefill, request_id, prompt, p, ticket,
                                                  transport))
        await self.wait_in_transfer(prefill)
        assert not call.done()
        victim.proc.popen.send_signal(signal.SIGKILL)
        victim.proc.popen.wait(10)
        return await rpc_error(asyncio.wait_for(call, 30))

    async def wait_idle(self, workers: Iterable[Worker], timeout: float = 15.0) -> None:
        """Until every block of every worker is free and nothing runs or
        waits there; fails with the last Info of each worker otherwise."""
        workers = list(workers)
        deadline = time.monotonic() + timeout
        while True:
            infos = [await self.info(w) for w in workers]
            if all(i.free_blocks == i.num_blocks and not i.num_running and not i.num_waiting
                   for i in infos):
                return
            if time.monotonic() > deadline:
                state = "; ".join(
                    f"{i.worker_id}: {i.free_blocks}/{i.num_blocks} free, {i.num_running} "
                    f"running, {i.num_waiting} waiting" for i in infos
                )
                raise AssertionError(f"workers did not come back to idle: {state}")
            await asyncio.sleep(0.05)


async def rpc_error(coro) -> grpc.aio.AioRpcError:
    """The status a call failed with (fails the test if it succeeded)."""
    try:
        await coro
    except grpc.aio.AioRpcError as err:
        return err
    raise AssertionError("the call succeeded; expected an error status")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text format, or None."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None
