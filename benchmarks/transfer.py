"""KV transfer throughput of each transport against raw loopback baselines.

    PYTHONPATH=. python benchmarks/transfer.py [--sizes-mib 1 16 64] [--repeats 5]

One decode worker runs as its own process on a small random model whose KV
is 16 KiB per token (4 layers, 4 kv heads, head dim 128, float32), so a
payload of N MiB is a prompt of 64*N tokens. This process plays the prefill
worker: for each payload it reserves the blocks (Reserve), moves them with
the real sender (``GrpcSender``: PushKV; ``TorchSender``: ExpectKV + gloo
send; ``MooncakeSender``: WriteKV around one-sided batch writes of the
Mooncake transfer engine over its TCP protocol, from this process's
registered cache into the decode worker's) and frees them (Abort). Each transfer ends at the decode worker's
acknowledgement, after the bytes are in its KV cache.

The baselines move the same number of bytes between this process and a
child process, also ending at a one-byte acknowledgement:

    raw tcp    socket.sendall / recv_into over loopback
    raw gloo   ProcessGroupGloo send / recv, a two-rank group

Throughput is MiB per second, the median of the repeats. Not counted: a
warm-up per transport (first contact, with its preflight, then one transfer
of the largest payload, so the decode worker's cache pages are touched).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 4, 128, 16
TOKEN_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # K and V, float32: 16 KiB
TIMEOUT = datetime.timedelta(seconds=60)


def build_model(root: Path) -> Path:
    """A random Llama with big KV per token and almost no weights."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=KV_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    path = root / "kv-heavy"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


# ---- the transports, through a real decode worker ---------------------------------------------


async def bench_transports(address: str, sizes: list[int], repeats: int) -> dict:
    from engine.kv_blocks import KVBlocks
    from engine.sampling_params import SamplingParams
    from kv_transfer.grpc_transport import GrpcSender
    from kv_transfer.layout import KVLayout
    from kv_transfer.mooncake_endpoint import MooncakeEndpoint
    from kv_transfer.mooncake_transport import MooncakeSender
    from kv_transfer.torch_transport import TorchSender
    from rpc.convert import params_to_proto
    from rpc.pool import ChannelPool
    from rpc.protos import worker_pb2, worker_pb2_grpc

    channels = ChannelPool()
    stub = worker_pb2_grpc.WorkerStub(channels.get(address))
    info = await stub.Info(worker_pb2.InfoRequest())
    layout = KVLayout.from_proto(info.layout)
    max_blocks = max(sizes) * (1 << 20) // (TOKEN_BYTES * BLOCK_SIZE)
    shape = (max_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    io = KVBlocks([(torch.randn(shape), torch.randn(shape)) for _ in range(LAYERS)])
    senders = {"grpc": GrpcSender(io, layout, channels),
               "torch": TorchSender(io, layout, channels, "bench-prefill")}
    endpoint = None
    if "mooncake" in info.transports:
        endpoint = MooncakeEndpoint(io, "127.0.0.1")
        senders["mooncake"] = MooncakeSender(endpoint, layout, channels, "bench-prefill")
    else:
        print("  mooncake: the decode worker could not start it (see its log); skipped")
    params = params_to_proto(SamplingParams(max_tokens=1))
    counter = 0
    segments: dict[tuple[str, int], set[int]] = {}  # what the decode worker's blocks cost

    async def once(sender, mib: int) -> float:
        nonlocal counter
        counter += 1
        rid = f"bench-{counter}"
        tokens = [5] * (mib * (1 << 20) // TOKEN_BYTES)
        reply = await stub.Reserve(worker_pb2.ReserveRequest(
            request_id=rid, prompt_token_ids=tokens, params=params))
        ids = list(range(len(reply.ticket.block_ids)))
        try:
            stats = await sender.send(rid, reply.ticket, ids)
        finally:
            await stub.Abort(worker_pb2.AbortRequest(request_id=rid))
        if stats.bytes != mib << 20:
            raise RuntimeError(f"moved {stats.bytes} bytes, meant {mib << 20}")
        if "segments" in stats.extra:
            segments.setdefault((sender.name, mib), set()).add(stats.extra["segments"])
        return stats.seconds

    results: dict = {}
    for name, sender in senders.items():
        await once(sender, 1)  # first contact: group set-up and preflight
        await once(sender, max(sizes))  # touch (nearly) every block of the decode cache
        print(f"  preflight {name}: {sender.bandwidth[info.worker_id] / 2**20:.0f} MiB/s",
              flush=True)
        for mib in sizes:
            results[(name, mib)] = [await once(sender, mib) for _ in range(repeats)]
    await channels.close()
    if endpoint is not None:
        endpoint.close()
    for (name, mib), counts in sorted(segments.items()):
        print(f"  {name} {mib} MiB: {min(counts)}-{max(counts)} segments per transfer")
    return results


# ---- raw baselines ------------------------------------------------------------------------------


def tcp_receiver(conn, sizes: list[int], repeats: int) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    conn.send(server.getsockname()[1])
    sock, _ = server.accept()
    buf = bytearray(max(sizes) << 20)
    view = memoryview(buf)
    for mib in sizes:
        for _ in range(repeats + 1):
            want, got = mib << 20, 0
            while got < want:
                got += sock.recv_into(view[got:want])
            sock.sendall(b"k")
    sock.close()


def bench_tcp(sizes: list[int], repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=tcp_receiver, args=(there, sizes, repeats))
    child.start()
    sock = socket.create_connection(("127.0.0.1", here.recv()))
    results = {}
    for mib in sizes:
        payload = bytes(mib << 20)
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            sock.sendall(payload)
            sock.recv(1)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - start)
        results[("raw tcp", mib)] = times
    sock.close()
    child.join()
    return results


def gloo_receiver(port: int, sizes: list[int], repeats: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    group = dist.ProcessGroupGloo(store, 1, 2, TIMEOUT)
    ack = torch.ones(1, dtype=torch.uint8)
    for mib in sizes:
        buf = torch.empty(mib << 20, dtype=torch.uint8)
        for _ in range(repeats + 1):
            group.recv([buf], 0, 1).wait()
            group.send([ack], 0, 2).wait()


def bench_gloo(sizes: list[int], repeats: int) -> dict:
    from engine.parallel.store import listening_store

    store = listening_store("127.0.0.1", TIMEOUT)  # loopback only, not every interface
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=gloo_receiver, args=(store.port, sizes, repeats))
    child.start()
    group = dist.ProcessGroupGloo(store, 0, 2, TIMEOUT)
    ack = torch.empty(1, dtype=torch.uint8)
    results = {}
    for mib in sizes:
        payload = torch.zeros(mib << 20, dtype=torch.uint8)
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            group.send([payload], 1, 1).wait()
            group.recv([ack], 1, 2).wait()
            if i:
                times.append(time.perf_counter() - start)
        results[("raw gloo", mib)] = times
    child.join()
    return results


# ---- main ---------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sizes, repeats = args.sizes_mib, args.repeats

    from tandem.cluster import LocalCluster

    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp))
        blocks = max(sizes) * (1 << 20) // (TOKEN_BYTES * BLOCK_SIZE) + 16
        print(f"decode worker: {model.name}, {TOKEN_BYTES // 1024} KiB of KV per token, "
              f"{blocks} blocks", flush=True)
        with LocalCluster() as cluster:
            decode = cluster.start("decode", ["--model", str(model), "--num-blocks", str(blocks),
                                              "--dtype", "float32",  # this side's cache
                                              "--transport", "mooncake,grpc"])
            results.update(asyncio.run(bench_transports(decode.address, sizes, repeats)))
    print("  raw tcp ...", flush=True)
    results.update(bench_tcp(sizes, repeats))
    print("  raw gloo ...", flush=True)
    results.update(bench_gloo(sizes, repeats))

    columns = [c for c in ("grpc", "torch", "mooncake", "raw tcp", "raw gloo")
               if (c, sizes[0]) in results]
    print(f"\nKV transfer throughput, MiB/s (median of {repeats}; ms in brackets), "
          f"{torch.get_num_threads()} torch threads, {mp.cpu_count()} cpus")
    print(f"{'payload':>8} | " + " | ".join(f"{c:>18}" for c in columns))
    print("-" * (11 + 21 * len(columns)))
    for mib in sizes:
        cells = []
        for c in columns:
            sec = statistics.median(results[(c, mib)])
            cells.append(f"{mib / sec:>8.0f} ({sec * 1e3:>6.1f} ms)")
        print(f"{mib:>5} MiB | " + " | ".join(f"{x:>18}" for x in cells))


if __name__ == "__main__":
    main()
