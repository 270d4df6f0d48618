"""KV transfer throughput of each transport against raw loopback baselines.

    PYTHONPATH=. python benchmarks/transfer.py [--sizes-mib 1 16 64] [--repeats 5]
        [--mooncake-cores | --unplaced]

One decode worker runs as its own process on a small random model whose KV
is 16 KiB per token (4 layers, 4 kv heads, head dim 128, float32), so a
payload of N MiB is a prompt of 64*N tokens. This process plays the prefill
worker: for each payload it reserves the blocks (Reserve), moves them with
the real sender (``GrpcSender``: PushKV; ``TorchSender``: WriteKV around
one gloo send of every layer, announced on the pair's KVFrames stream;
``MooncakeSender``: WriteKV around one-sided batch writes of the
Mooncake transfer engine over its TCP protocol, from this process's
registered cache into the decode worker's) and frees them (Abort). Each
transfer is the sender's whole call, from its first message to the decode
worker's acknowledgement, after the bytes are in its KV cache. "mooncake engine" is the same batch write into the same
reserved blocks without the WriteKV control stream: the engine alone.

The baselines move the same number of bytes between this process and a
child process, also ending at a one-byte acknowledgement:

    raw tcp    socket.sendall / recv_into over loopback
    raw gloo   ProcessGroupGloo send / recv, a two-rank group

Every arm moves each payload once per repeat, taking turns, so that a
change in the machine's load hits them alike. Throughput is MiB per second,
the median of the repeats. Not counted: a warm-up per arm (first contact,
with its preflight, then one transfer of the largest payload, so the
decode worker's cache pages are touched).

The decode worker takes the cores ``tandem up`` gives it beside one prefill
worker (``split_cores``): it owns the second share and may borrow the
first; the mooncake engines' threads run wherever their process may, as in
a served pair. ``--mooncake-cores``: each side's engine threads on its own
share only (this process's on the first, the decode worker's
``--mooncake-cores`` on the second). ``--unplaced``: no worker cores at
all. The raw baselines are never pinned.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


async def transport_arms(stack, address: str, sizes: list[int], cores: list[int]) -> dict:
    """name -> async (MiB) -> seconds, for each sender against the decode worker."""
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
    stack.push_async_callback(channels.close)
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
        endpoint = MooncakeEndpoint(io, "127.0.0.1", cores=cores)
        stack.callback(endpoint.close)
        senders["mooncake"] = MooncakeSender(endpoint, layout, channels, "bench-prefill")
    else:
        print("  mooncake: the decode worker could not start it (see its log); skipped")
    params = params_to_proto(SamplingParams(max_tokens=1))
    counter = 0

    async def reserved(mib: int, move) -> float:
        """Reserve a request of ``mib`` MiB of KV, time ``move(ticket)``, abort."""
        nonlocal counter
        counter += 1
        rid = f"bench-{counter}"
        tokens = [5] * (mib * (1 << 20) // TOKEN_BYTES)
        reply = await stub.Reserve(worker_pb2.ReserveRequest(
            request_id=rid, prompt_token_ids=tokens, params=params))
        try:
            return await move(rid, reply.ticket)
        finally:
            await stub.Abort(worker_pb2.AbortRequest(request_id=rid))

    def through(sender):
        async def move(rid, ticket) -> float:
            start = time.perf_counter()
            stats = await sender.send(rid, ticket, list(range(len(ticket.block_ids))))
            seconds = time.perf_counter() - start  # the whole call, control messages too
            if stats.bytes != len(ticket.block_ids) * BLOCK_SIZE * TOKEN_BYTES:
                raise RuntimeError(f"moved {stats.bytes} bytes")
            if "segments" in stats.extra:
                SEGMENTS.setdefault((sender.name, len(ticket.block_ids)), set()).add(
                    stats.extra["segments"])
            return seconds

        return lambda mib: reserved(mib, move)

    async def engine_only(rid, ticket) -> float:
        """The same batch write into the reserved blocks, without the WriteKV
        control stream: the transfer engine alone."""
        ids = list(range(len(ticket.block_ids)))
        segments = endpoint.segments(ticket.mooncake, ids, list(ticket.block_ids))
        start = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(
            endpoint.thread, endpoint.write, ticket.mooncake.rpc_address, *segments)
        return time.perf_counter() - start

    arms = {name: through(sender) for name, sender in senders.items()}
    if endpoint is not None:
        arms["mooncake engine"] = lambda mib: reserved(mib, engine_only)
    for name, arm in arms.items():
        await arm(1)  # first contact: group set-up and preflight
        await arm(max(sizes))  # touch the decode worker's blocks this benchmark uses
        sender = senders.get(name)
        if sender is not None:
            print(f"  preflight {name}: {sender.bandwidth[info.worker_id] / 2**20:.0f} MiB/s",
                  flush=True)
    return arms


SEGMENTS: dict[tuple[str, int], set[int]] = {}  # (transport, blocks) -> segments per transfer


# ---- raw baselines: a child process receives, this one sends ----------------------------------


def tcp_receiver(conn, nbytes: int) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    conn.send(server.getsockname()[1])
    sock, _ = server.accept()
    buf = bytearray(nbytes)
    view = memoryview(buf)
    while True:
        head = sock.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        want, got = int.from_bytes(head, "little"), 0
        while got < want:
            got += sock.recv_into(view[got:want])
        sock.sendall(b"k")


def gloo_receiver(port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    group = dist.ProcessGroupGloo(store, 1, 2, TIMEOUT)
    ack, size = torch.ones(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64)
    while True:
        group.recv([size], 0, 1).wait()
        if not size.item():
            return
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        group.recv([buf], 0, 1).wait()
        group.send([ack], 0, 2).wait()


def raw_arms(stack, sizes: list[int]) -> dict:
    """name -> async (MiB) -> seconds: the same bytes from one preallocated
    buffer to a child process, ending at a one-byte acknowledgement."""
    from engine.parallel.store import listening_store

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    tcp_child = ctx.Process(target=tcp_receiver, args=(there, max(sizes) << 20), daemon=True)
    tcp_child.start()
    sock = socket.create_connection(("127.0.0.1", here.recv()))
    stack.callback(tcp_child.join)
    stack.callback(sock.close)

    store = listening_store("127.0.0.1", TIMEOUT)  # loopback only, not every interface
    gloo_child = ctx.Process(target=gloo_receiver, args=(store.port,), daemon=True)
    gloo_child.start()
    group = dist.ProcessGroupGloo(store, 0, 2, TIMEOUT)
    stack.callback(gloo_child.join)
    stack.callback(lambda: group.send([torch.zeros(1, dtype=torch.int64)], 1, 1).wait())
    payloads: dict[int, bytes] = {}
    tensors: dict[int, torch.Tensor] = {}
    ack = torch.empty(1, dtype=torch.uint8)

    async def tcp(mib: int) -> float:
        data = payloads.setdefault(mib, bytes(mib << 20))
        start = time.perf_counter()
        sock.sendall((mib << 20).to_bytes(8, "little"))
        sock.sendall(data)
        sock.recv(1)
        return time.perf_counter() - start

    async def gloo(mib: int) -> float:
        data = tensors.setdefault(mib, torch.zeros(mib << 20, dtype=torch.uint8))
        start = time.perf_counter()
        group.send([torch.tensor([mib << 20], dtype=torch.int64)], 1, 1).wait()
        group.send([data], 1, 1).wait()
        group.recv([ack], 1, 2).wait()
        return time.perf_counter() - start

    return {"raw tcp": tcp, "raw gloo": gloo}


async def bench(address: str, sizes: list[int], repeats: int, cores: list[int]) -> dict:
    """Every arm once per repeat, in turn: a change in the machine's load
    hits them alike."""
    async with contextlib.AsyncExitStack() as stack:
        arms = await transport_arms(stack, address, sizes, cores)
        raw = raw_arms(stack, sizes)
        for arm in raw.values():
            await arm(max(sizes))  # warm-up
        arms.update(raw)
        results: dict = {}
        for mib in sizes:
            for _ in range(repeats):
                for name, arm in arms.items():
                    results.setdefault((name, mib), []).append(await arm(mib))
        return results


# ---- main ---------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=5)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--mooncake-cores", action="store_true",
                       help="each side's mooncake engine threads on its own share of the cores")
    where.add_argument("--unplaced", action="store_true",
                       help="no worker cores: every thread where the kernel puts it")
    args = ap.parse_args()
    sizes, repeats = args.sizes_mib, args.repeats

    from tandem.cluster import LocalCluster
    from worker.cpu_cores import parse_cores, placement_flags, split_cores

    # Cores as `tandem up` deals them to one prefill and one decode worker:
    # the decode worker owns the second share and may borrow the first.
    shares = None if args.unplaced else split_cores(2)
    placed = [] if shares is None else placement_flags(shares)[1]
    own = []  # this side's mooncake engine cores
    if shares is not None and args.mooncake_cores:
        placed += ["--mooncake-cores", shares[1]]
        own = parse_cores(shares[0])

    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp))
        blocks = max(sizes) * (1 << 20) // (TOKEN_BYTES * BLOCK_SIZE) + 16
        print(f"decode worker: {model.name}, {TOKEN_BYTES // 1024} KiB of KV per token, "
              f"{blocks} blocks", flush=True)
        with LocalCluster() as cluster:
            decode = cluster.start("decode", ["--model", str(model), "--num-blocks", str(blocks),
                                              "--dtype", "float32",  # this side's cache
                                              "--transport", "mooncake,grpc", *placed])
            results.update(asyncio.run(bench(decode.address, sizes, repeats, own)))
    for (name, blocks), counts in sorted(SEGMENTS.items()):
        print(f"  {name}, {blocks} blocks: {min(counts)}-{max(counts)} segments per transfer")

    columns = [c for c in ("grpc", "torch", "mooncake", "mooncake engine", "raw tcp", "raw gloo")
               if (c, sizes[0]) in results]
    print(f"\nKV transfer throughput, MiB/s (median of {repeats}; ms in brackets), "
          f"{torch.get_num_threads()} torch threads, {mp.cpu_count()} cpus, "
          + ("unplaced" if shares is None else f"decode worker on cores {shares[1]}, borrowing "
             f"{shares[0]}; mooncake threads "
             + (f"on {shares[0]} (this side) / {shares[1]}" if own else "free")))
    print(f"{'payload':>8} | " + " | ".join(f"{c:>18}" for c in columns))
    print("-" * (11 + 21 * len(columns)))
    for mib in sizes:
        cells = []
        for c in columns:
            sec = statistics.median(results[(c, mib)])
            cells.append(f"{mib / sec:>8.0f} ({sec * 1e3:>6.1f} ms)")
        print(f"{mib:>5} MiB | " + " | ".join(f"{x:>18}" for x in cells))
    if ("mooncake", sizes[0]) in results:
        for mib in sizes:
            tcp = statistics.median(results[("raw tcp", mib)])
            print(f"  {mib} MiB: mooncake at {tcp / statistics.median(results[('mooncake', mib)]):.0%}"
                  f" of raw tcp, the engine alone at "
                  f"{tcp / statistics.median(results[('mooncake engine', mib)]):.0%}")


if __name__ == "__main__":
    main()
