"""The KV handoff in one process: the wire header, raw block bytes, and the
decode side's receiver refusing whatever does not fit its reservation."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import pickle
import threading

import grpc
import pytest
import torch
import torch.distributed as dist

from engine.kv_blocks import KVBlocks
from kv_transfer.block_io import from_bytes, to_bytes
from kv_transfer.layout import KVLayout
from kv_transfer.receiver import MAX_PREFLIGHT_BYTES, KVReceiver
from kv_transfer.torch_frames import done_frame, payload_frame
from kv_transfer.torch_pair import PAYLOAD_TAG, PREFLIGHT_TAG, PairGroup, make_group
from rpc.errors import Fenced, LayoutMismatch, NotFound, status_for
from rpc.protos import worker_pb2

NUM_BLOCKS, BLOCK_SIZE, LAYERS, KV_HEADS, HEAD_DIM = 8, 4, 2, 2, 8


def layout(**changes) -> KVLayout:
    base = KVLayout(model_fingerprint="0123abcd", dtype="float32", block_size=BLOCK_SIZE,
                    num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    return dataclasses.replace(base, **changes)


def caches(dtype=torch.float32, fill: str = "random") -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    make = (lambda: torch.randn(shape).to(dtype)) if fill == "random" else (
        lambda: torch.zeros(shape, dtype=dtype))
    return [(make(), make()) for _ in range(LAYERS)]


# ---- the wire header -------------------------------------------------------------------------


def test_same_layout_is_compatible():
    layout().check_compatible(layout())
    assert KVLayout.from_proto(layout().to_proto()) == layout()


@pytest.mark.parametrize("field,value", [
    ("model_fingerprint", "ffffeeee"), ("dtype", "bfloat16"), ("block_size", 32),
    ("num_layers", 3), ("num_kv_heads", 4), ("head_dim", 64), ("layout", "HND"),
    ("tp_rank_map", (0, 1)), ("wire_version", 2),
])
def test_each_field_mismatch_is_named_with_both_values(field, value):
    mine, theirs = layout(), layout(**{field: value})
    with pytest.raises(LayoutMismatch) as exc:
        mine.check_compatible(theirs, "decode worker d1")
    msg = str(exc.value)
    assert f"{field}: this worker {getattr(mine, field)!r}, decode worker d1 {value!r}" in msg
    assert status_for(exc.value) == grpc.StatusCode.FAILED_PRECONDITION


def test_mismatch_lists_every_differing_field():
    with pytest.raises(LayoutMismatch) as exc:
        layout().check_compatible(layout(model_fingerprint="other", num_kv_heads=1), "sender")
    msg = str(exc.value)
    assert "model_fingerprint" in msg and "num_kv_heads" in msg and "dtype" not in msg


@pytest.mark.parametrize("dtype,size", [("float32", 4), ("float16", 2), ("bfloat16", 2)])
def test_block_bytes(dtype, size):
    assert layout(dtype=dtype).block_bytes_per_layer == 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * size


# ---- blocks as bytes ---------------------------------------------------------------------------


@pytest.fixture
def no_pickle(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle on the KV path")

    monkeypatch.setattr(pickle, "dumps", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "save", refuse)
    monkeypatch.setattr(torch, "load", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_blocks_round_trip_as_raw_bytes(dtype, no_pickle):
    src, dst = KVBlocks(caches(dtype)), KVBlocks(caches(dtype, fill="zeros"))
    data = to_bytes(src.read([5, 0, 3]))
    itemsize = torch.finfo(dtype).bits // 8
    assert len(data) == LAYERS * 2 * 3 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * itemsize
    dst.write([1, 2, 7], from_bytes(data, dst.empty(LAYERS, 3)))
    for (sk, sv), (dk, dv) in zip(src.kv_caches, dst.kv_caches):
        for s, d in ((sk, dk), (sv, dv)):
            assert torch.equal(d[[1, 2, 7]], s[[5, 0, 3]])  # bit for bit
            assert not d[[0, 3, 4, 5, 6]].any()  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_layer_round_trip(dtype, no_pickle):
    src, dst = KVBlocks(caches(dtype)), KVBlocks(caches(dtype, fill="zeros"))
    data = to_bytes(src.read_layer(1, [6, 2]))
    dst.write_layer(1, [0, 4], from_bytes(data, dst.empty(None, 2)))
    assert torch.equal(dst.kv_caches[1][0][[0, 4]], src.kv_caches[1][0][[6, 2]])
    assert torch.equal(dst.kv_caches[1][1][[0, 4]], src.kv_caches[1][1][[6, 2]])
    assert not dst.kv_caches[0][0].any()


def test_bytes_are_little_endian_values():
    assert to_bytes(torch.tensor([1.0], dtype=torch.float32)) == b"\x00\x00\x80\x3f"
    assert to_bytes(torch.tensor([1.0], dtype=torch.bfloat16)) == b"\x80\x3f"


# ---- the receiver ---------------------------------------------------------------------------


class Receiver:
    """A KVReceiver over a zeroed cache, with a source cache to send from."""

    def __init__(self, dtype=torch.float32) -> None:
        self.src = KVBlocks(caches(dtype))
        self.dst = KVBlocks(caches(dtype, fill="zeros"))
        self.released: list[str] = []
        self.transfers: list[tuple] = []
        self.layout = layout(dtype=str(dtype).removeprefix("torch."))
        self.rx = KVReceiver(self.dst, self.layout, release=self.released.append)
        self.rx.on_transfer.append(lambda *a: self.transfers.append(a))

    def chunks(self, request_id: str, src_ids: list[int], attempt: int = 0,
               per_chunk: int = 2, header: KVLayout | None = None) -> list[worker_pb2.KVChunk]:
        out = []
        for layer in range(LAYERS):
            for lo in range(0, len(src_ids), per_chunk):
                ids = src_ids[lo : lo + per_chunk]
                out.append(worker_pb2.KVChunk(
                    request_id=request_id, layer=layer, first_block=lo, num_blocks=len(ids),
                    data=to_bytes(self.src.read_layer(layer, ids)), attempt=attempt,
                    layout=(header or self.layout).to_proto() if not out else None,
                ))
        return out

    def assert_landed(self, src_ids: list[int], dst_ids: list[int]) -> None:
        for (sk, sv), (dk, dv) in zip(self.src.kv_caches, self.dst.kv_caches):
            assert torch.equal(dk[dst_ids], sk[src_ids]) and torch.equal(dv[dst_ids], sv[src_ids])


async def stream(chunks):
    for c in chunks:
        yield c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_receiver_writes_exactly_the_reserved_blocks(dtype):
    r = Receiver(dtype)
    r.rx.expect("req", [6, 1, 3], attempt=2)
    nbytes = await r.rx.receive_grpc(stream(r.chunks("req", [0, 4, 5], attempt=2)))
    assert nbytes == 3 * LAYERS * r.layout.block_bytes_per_layer
    assert r.rx.is_complete("req")
    r.assert_landed([0, 4, 5], [6, 1, 3])
    assert not r.dst.kv_caches[0][0][[0, 2, 4, 5, 7]].any()
    assert r.transfers[-1][0] == "grpc" and r.transfers[-1][1] == nbytes and r.transfers[-1][3]


async def test_receiver_refuses_unknown_request():
    r = Receiver()
    with pytest.raises(NotFound, match="no reservation for request 'ghost'"):
        await r.rx.receive_grpc(stream(r.chunks("ghost", [0])))


async def test_receiver_refuses_stale_attempt():
    r = Receiver()
    r.rx.expect("req", [1, 2], attempt=3)
    with pytest.raises(Fenced, match="attempt 2"):
        await r.rx.receive_grpc(stream(r.chunks("req", [0, 1], attempt=2)))
    assert not r.dst.kv_caches[0][0].any()
    # The current attempt still can.
    await r.rx.receive_grpc(stream(r.chunks("req", [0, 1], attempt=3)))
    r.assert_landed([0, 1], [1, 2])


async def test_receiver_refuses_blocks_outside_the_reservation():
    r = Receiver()
    r.rx.expect("req", [1, 2, 3], attempt=0)
    bad = r.chunks("req", [0, 1, 2], per_chunk=2)
    bad[0].first_block = 2  # blocks [2, 4) of a 3-block reservation
    with pytest.raises(ValueError, match=r"blocks \[2, 4\) outside the 3 reserved"):
        await r.rx.receive_grpc(stream(bad))
    assert not r.rx.is_complete("req") and not r.rx.reservations["req"].writing
    assert not r.transfers[-1][3]  # counted as a failed transfer
    # A clean retry of the same reservation works.
    await r.rx.receive_grpc(stream(r.chunks("req", [0, 1, 2])))
    r.assert_landed([0, 1, 2], [1, 2, 3])


@pytest.mark.parametrize("cut", [-1, 1])
async def test_receiver_refuses_wrong_chunk_size(cut):
    r = Receiver()
    r.rx.expect("req", [1, 2], attempt=0)
    bad = r.chunks("req", [0, 1])
    bad[0].data = bad[0].data[:cut] if cut < 0 else bad[0].data + b"\0"
    with pytest.raises(ValueError, match="KV chunk of .* bytes, expected"):
        await r.rx.receive_grpc(stream(bad))


async def test_receiver_refuses_incomplete_and_empty_streams():
    r = Receiver()
    r.rx.expect("req", [1, 2], attempt=0)
    with pytest.raises(ValueError, match="received .* KV bytes, expected"):
        await r.rx.receive_grpc(stream(r.chunks("req", [0, 1])[:1]))
    with pytest.raises(ValueError, match="empty KV stream"):
        await r.rx.receive_grpc(stream([]))
    assert not r.rx.is_complete("req")


async def test_receiver_refuses_a_second_copy():
    r = Receiver()
    r.rx.expect("req", [1], attempt=0)
    await r.rx.receive_grpc(stream(r.chunks("req", [0])))
    with pytest.raises(ValueError, match="already being received"):
        await r.rx.receive_grpc(stream(r.chunks("req", [3])))
    r.assert_landed([0], [1])


async def test_receiver_refuses_a_sender_of_another_layout():
    r = Receiver()
    r.rx.expect("req", [1], attempt=0)
    with pytest.raises(LayoutMismatch, match="num_kv_heads: this worker 2, sender 4"):
        await r.rx.receive_grpc(stream(r.chunks("req", [0], header=layout(num_kv_heads=4))))


async def test_abort_while_writing_releases_when_the_writer_stops():
    r = Receiver()
    r.rx.expect("req", [1, 2], attempt=0)
    chunks = r.chunks("req", [0, 1])
    first_written = asyncio.Event()

    async def slow():
        yield chunks[0]
        first_written.set()
        await asyncio.sleep(0.05)
        for c in chunks[1:]:
            yield c

    receiving = asyncio.ensure_future(r.rx.receive_grpc(slow()))
    await first_written.wait()
    assert r.rx.cancel("req") is False  # in use: not freed yet
    assert r.released == []
    with pytest.raises(NotFound, match="aborted during the transfer"):
        await receiving
    assert r.released == ["req"] and "req" not in r.rx.reservations


async def test_cancel_of_an_idle_reservation_frees_at_once():
    r = Receiver()
    r.rx.expect("req", [1, 2], attempt=0)
    assert r.rx.cancel("req") is True and "req" not in r.rx.reservations
    assert r.rx.cancel("never") is True


async def test_preflight_bytes_are_counted_and_bounded():
    r = Receiver()
    ok = [worker_pb2.PreflightChunk(data=bytes(1000))] * 3
    assert await r.rx.receive_preflight(stream(ok)) == 3000
    big = [worker_pb2.PreflightChunk(data=bytes(MAX_PREFLIGHT_BYTES // 2 + 1))] * 2
    with pytest.raises(ValueError, match="preflight of more than"):
        await r.rx.receive_preflight(stream(big))


# ---- the receiver over a real gloo pair (both ranks in this process) --------------------------


class GlooSender:
    """Rank 0 of a pair group whose rank 1 is the receiver under test."""

    def __init__(self) -> None:
        timeout = datetime.timedelta(seconds=10)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timeout)
        self.name = f"kv/unit/{id(self)}"
        self.group = None
        self._thread = threading.Thread(target=self._build)
        self._thread.start()

    def _build(self) -> None:
        self.group = make_group(dist.PrefixStore(self.name, self.store), 0, torch.device("cpu"))

    def open_request(self, preflight_bytes: int = 0) -> worker_pb2.OpenTransferGroupRequest:
        return worker_pb2.OpenTransferGroupRequest(
            prefill_worker_id="p0", store_address=f"127.0.0.1:{self.store.port}",
            group_name=self.name, preflight_bytes=preflight_bytes)

    async def send(self, t: torch.Tensor, tag: int) -> None:
        self._thread.join()
        await asyncio.to_thread(lambda: self.group.send([t], 1, tag).wait())

    async def recv(self, t: torch.Tensor, tag: int) -> None:
        await asyncio.to_thread(lambda: self.group.recv([t], 1, tag).wait())


class Feed:
    """A client stream fed by the test, one message at a time."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, message) -> None:
        self.queue.put_nowait(message)

    def end(self) -> None:
        self.queue.put_nowait(None)

    def __aiter__(self):
        return self

    async def __anext__(self):
        message = await self.queue.get()
        if message is None:
            raise StopAsyncIteration
        return message


def begin_torch(request_id: str, num_blocks: int, lay: KVLayout, attempt: int = 0):
    return worker_pb2.WriteKVMessage(begin=worker_pb2.WriteKVBegin(
        request_id=request_id, prefill_worker_id="p0", layout=lay.to_proto(),
        num_blocks=num_blocks, attempt=attempt, transport="torch"))


def done_message(num_blocks: int):
    return worker_pb2.WriteKVMessage(done=worker_pb2.WriteKVDone(num_blocks=num_blocks))


async def test_torch_receive_preflight_refusal_and_success():
    r = Receiver()
    sender = GlooSender()
    await r.rx.open_group(sender.open_request(preflight_bytes=4096))
    assert isinstance(r.rx.groups["p0"], PairGroup)
    # The preflight: 4 KiB in, one byte back.
    await sender.send(torch.zeros(4096, dtype=torch.uint8), PREFLIGHT_TAG)
    ack = torch.zeros(1, dtype=torch.uint8)
    await sender.recv(ack, PREFLIGHT_TAG)
    assert ack.item() == 1

    # The frames must name the pair's group.
    wrong = Feed()
    wrong.put(worker_pb2.KVFrame(open=worker_pb2.KVFramesOpen(prefill_worker_id="p0",
                                                              group_name="kv/other")))
    with pytest.raises(NotFound, match="no transfer group"):
        await r.rx.receive_frames(wrong)
    frames = Feed()
    frames.put(worker_pb2.KVFrame(open=worker_pb2.KVFramesOpen(prefill_worker_id="p0",
                                                               group_name=sender.name)))
    receiving = asyncio.ensure_future(r.rx.receive_frames(frames))

    async def payload(rid: str, layer: int, first: int, src: list[int]) -> None:
        frames.put(payload_frame(rid, 0, layer, first, len(src)))
        data = r.src.read(src) if layer < 0 else r.src.read_layer(layer, src)
        await asyncio.wait_for(sender.send(data, PAYLOAD_TAG), 5)

    # Refused at begin (no reservation, wrong block count): nothing is sent.
    with pytest.raises(NotFound):
        await anext(r.rx.receive_writes(stream([begin_torch("ghost", 2, r.layout)])))
    r.rx.expect("req", [3, 6], attempt=0)
    with pytest.raises(ValueError, match="1 blocks announced, 2 reserved"):
        await anext(r.rx.receive_writes(stream([begin_torch("req", 1, r.layout)])))

    # A transfer layer by layer, in two chunks of blocks, while payloads of a
    # request that is not being received pass through and are dropped.
    control = Feed()
    control.put(begin_torch("req", 2, r.layout))
    replies = r.rx.receive_writes(control)
    assert (await anext(replies)).ready
    for layer in range(LAYERS):
        await payload("req", layer, 0, [0])
    await payload("stray", -1, 0, [1, 2])
    for layer in range(LAYERS):
        await payload("req", layer, 1, [4])
    frames.put(done_frame("req", 0))
    control.put(done_message(2))
    reply = await anext(replies)
    assert reply.bytes_received == 2 * r.layout.block_bytes_per_layer * LAYERS
    assert r.rx.is_complete("req")
    r.assert_landed([0, 4], [3, 6])
    assert not receiving.done()

    # A payload no reservation could hold: the pair is out of step, and closed.
    frames.put(payload_frame("req", 0, 0, 0, r.dst.num_blocks + 1))
    with pytest.raises(ValueError, match="a payload of"):
        await receiving
    assert r.rx.groups["p0"].broken
