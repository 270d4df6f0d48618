"""A mooncake write of many small segments: two endpoints in this process,
every other block of a 30-layer cache moved (so no run of blocks merges),
three writes in a row, then one single-block write.

    PYTHONPATH=. .venv/bin/python benchmarks/mooncake_segments.py --blocks 300

300 blocks are 18000 segments of 3 KiB, what a 4.9k-token prompt in a
fragmented cache makes. Each write prints its time, or its error.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.kv_blocks import KVBlocks
from kv_transfer.mooncake_endpoint import MooncakeEndpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=300, help="blocks moved (at most 1024)")
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    shape = (2048, 16, 3, 16)  # 3 KiB per block in each of K and V, float32
    src = KVBlocks([(torch.randn(shape), torch.randn(shape)) for _ in range(args.layers)])
    dst = KVBlocks([(torch.zeros(shape), torch.zeros(shape)) for _ in range(args.layers)])
    a, b = MooncakeEndpoint(src, "127.0.0.1"), MooncakeEndpoint(dst, "127.0.0.1")
    try:
        ids, to = list(range(0, 2048, 2))[:args.blocks], list(range(1, 2048, 2))[:args.blocks]
        segments = a.segments(b.target(), ids, to)
        print(f"{len(segments[0])} segments, {sum(segments[2]) / 2**20:.1f} MiB")
        for run in range(3):
            start = time.perf_counter()
            try:
                a.write(b.rpc_address, *segments)
                exact = torch.equal(dst.read(to), src.read(ids))
                print(f"write {run + 1}: {time.perf_counter() - start:.2f} s, exact: {exact}")
            except Exception as exc:  # noqa: BLE001 - what the write says is the result
                print(f"write {run + 1}: failed after {time.perf_counter() - start:.2f} s: {exc}")
        one = a.segments(b.target(), [0], [1])
        a.write(b.rpc_address, *one)
        print("a single-block write after them: landed")
    finally:
        a.close()
        b.close()


if __name__ == "__main__":
    main()
