"""How the leader of a tensor-parallel group spread over hosts talks to the
ranks on other nodes: length-prefixed frames over one TCP connection per
rank, each a JSON header and raw array bytes. No pickle: a frame decodes to
plain data or is refused.

    frame   = MAGIC (4 bytes) | header length (u32) | payload length (u32)
              | header (UTF-8 JSON) | payload (the arrays' bytes, in order)

The commands are those a local follower gets down its pipe
(engine/parallel/followers.py): ``("forward", StepBatch, logit_calls)``,
``("read_kv", block_ids, layer)``, ``("write_kv", block_ids, layer)`` and
``None`` (stop). The handshake frames (hello, welcome, ready) are headers
alone.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct

import numpy as np

from engine.batch import StepBatch

MAGIC = b"TDT1"  # the protocol's version is in it: a peer of another version is refused
_PREFIX = struct.Struct(">4sII")
_MAX_HEADER = 16 << 20
_MAX_PAYLOAD = 1 << 31
# What a StepBatch's arrays may hold (token ids, positions, slots, lengths).
_ARRAY_DTYPES = {"int32", "int64", "bool"}


class WireError(ConnectionError):
    """The peer closed the connection, or sent something that is not a frame."""


def send_frame(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    body = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_PREFIX.pack(MAGIC, len(body), len(payload)) + body)
    if payload:
        sock.sendall(payload)


def recv_frame(sock: socket.socket) -> tuple[dict, bytearray]:
    """The next frame's header and payload; WireError at EOF or on garbage."""
    magic, header_len, payload_len = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
    if magic != MAGIC:
        raise WireError(f"not a Tandem tensor-parallel peer of this version (magic {magic!r})")
    if header_len > _MAX_HEADER or payload_len > _MAX_PAYLOAD:
        raise WireError(f"frame too large ({header_len} + {payload_len} bytes)")
    try:
        header = json.loads(bytes(_recv_exact(sock, header_len)))
    except ValueError as exc:
        raise WireError(f"a frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("a frame header is not a JSON object")
    return header, _recv_exact(sock, payload_len)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise WireError("the connection was closed")
        got += k
    return buf


# ---- commands ---------------------------------------------------------------------------


def encode_command(command: tuple | None) -> tuple[dict, bytes]:
    if command is None:
        return {"op": "stop"}, b""
    kind, *args = command
    if kind in ("read_kv", "write_kv"):
        block_ids, layer = args
        return {"op": kind, "block_ids": [int(b) for b in block_ids],
                "layer": None if layer is None else int(layer)}, b""
    if kind == "forward":
        batch, calls = args
        header, payload = _encode_batch(batch)
        header.update(op="forward", calls=[[int(r) for r in rows] for rows in calls])
        return header, payload
    raise ValueError(f"tensor-parallel command {kind!r} cannot be sent to another node")


def decode_command(header: dict, payload: bytearray) -> tuple | None:
    """The command a frame carries; WireError if it is not one."""
    op = header.get("op")
    try:
        if op == "stop":
            return None
        if op in ("read_kv", "write_kv"):
            layer = header["layer"]
            return (op, [int(b) for b in header["block_ids"]],
                    None if layer is None else int(layer))
        if op == "forward":
            calls = [[int(r) for r in rows] for rows in header["calls"]]
            return ("forward", _decode_batch(header, payload), calls)
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"a malformed {op!r} command: {exc}") from None
    raise WireError(f"unknown tensor-parallel command {op!r}")


def _encode_batch(batch: StepBatch) -> tuple[dict, bytes]:
    """Every field of the StepBatch: numpy arrays as bytes, plain values in
    the header (so a field added to StepBatch travels, or fails here)."""
    arrays, values, chunks = [], {}, []
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, np.ndarray):
            a = np.ascontiguousarray(value)
            arrays.append([f.name, a.dtype.name, list(a.shape)])
            chunks.append(a.tobytes())
        elif value is None or isinstance(value, (bool, int, float, str)):
            values[f.name] = value
        else:
            raise TypeError(f"StepBatch.{f.name} ({type(value).__name__}) cannot be sent to "
                            "another node: give engine/parallel/wire.py a way to")
    return {"arrays": arrays, "values": values}, b"".join(chunks)


def _decode_batch(header: dict, payload: bytearray) -> StepBatch:
    fields: dict = dict(header["values"])
    offset = 0
    view = memoryview(payload)
    for name, dtype, shape in header["arrays"]:
        if dtype not in _ARRAY_DTYPES:
            raise ValueError(f"array dtype {dtype!r}")
        count = int(np.prod(shape, dtype=np.int64))
        size = count * np.dtype(dtype).itemsize
        if offset + size > len(payload):
            raise ValueError("the payload is shorter than its arrays")
        # NOTE: the payload is a bytearray, so the arrays are writable (torch
        # warns about tensors made from read-only numpy arrays).
        fields[name] = np.frombuffer(view[offset:offset + size], dtype=dtype).reshape(shape)
        offset += size
    if offset != len(payload):
        raise ValueError("the payload is longer than its arrays")
    return StepBatch(**fields)
