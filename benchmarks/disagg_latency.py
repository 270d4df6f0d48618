"""Time to first token and decode speed, disaggregated against colocated.

    PYTHONPATH=. python benchmarks/disagg_latency.py [--lengths 128 512 2048] [--requests 2]
        [--max-tokens 16] [--transports grpc torch mooncake] [--model DIR_OR_GGUF]

The model is the bundled SmolLM2-135M unless --model says otherwise (its
GGUF is converted on the first start and cached). Two set-ups run one after
the other, never at the same time:

    disagg-grpc / disagg-torch   1 prefill + 1 decode worker; the same two
    / disagg-mooncake            processes, KV over the grpc transport, then
                                 over torch.distributed (gloo on the CPU), then
                                 the Mooncake engine (tcp; when asked for)
    colocated                    1 worker with role "both"

This process plays the gateway (Reserve -> Prefill -> Decode, or one Decode
on the colocated worker) and sends requests one at a time, so the numbers
are latencies, not batched throughput. Prompts are random token ids, a
different prompt per request (no prefix-cache hits); greedy, ignore_eos,
``--max-tokens`` output tokens each. A short warm-up request per set-up and
transport (first contact: channels, process group, preflight) is not
counted. Reservations get a long lease: a slow CPU prefill must not outlive it.

    TTFT         from the first call (Reserve, or the colocated Decode) to the
                 first streamed token at this process
    prefill      the Prefill call: prompt compute, KV transfer, acknowledgement
    transfer     of which the KV transfer (the prefill worker's own clock)
    decode tok/s (tokens - 1) / (last token time - first token time)

Medians over the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sampling_params import SamplingParams  # noqa: E402
from rpc.convert import params_to_proto  # noqa: E402
from rpc.pool import ChannelPool  # noqa: E402
from rpc.protos import worker_pb2, worker_pb2_grpc  # noqa: E402
from tandem.cluster import LocalCluster  # noqa: E402

# SmolLM2's special tokens sit at the start of its vocabulary: prompts avoid them.
LOW_TOKEN = 100
LEASE_MS = 600_000
WARMUP_TOKENS = 32


@dataclass
class Sample:
    ttft: float
    decode_tps: float
    prefill: float = 0.0
    transfer: float = 0.0
    kv_bytes: int = 0


@dataclass
class Gateway:
    channels: ChannelPool = field(default_factory=ChannelPool)
    ids: int = 0

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self.channels.get(address))

    def rid(self) -> str:
        self.ids += 1
        return f"bench-{self.ids}"

    async def stream(self, address: str, req: worker_pb2.DecodeRequest, start: float,
                     sample: Sample) -> Sample:
        first = last = None
        tokens = 0
        async for chunk in self.stub(address).Decode(req):
            if chunk.token_ids:
                last = time.perf_counter()
                first = first or last
                tokens += len(chunk.token_ids)
        sample.ttft = first - start
        sample.decode_tps = (tokens - 1) / (last - first) if last > first else float("nan")
        return sample

    async def disaggregated(self, prefill: str, decode: str, prompt: list[int], params,
                            transport: str) -> Sample:
        rid = self.rid()
        start = time.perf_counter()
        ticket = (await self.stub(decode).Reserve(worker_pb2.ReserveRequest(
            request_id=rid, prompt_token_ids=prompt, params=params, lease_ms=LEASE_MS))).ticket
        t = time.perf_counter()
        first = await self.stub(prefill).Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=params, ticket=ticket,
            transport=transport))
        sample = Sample(0, 0, prefill=time.perf_counter() - t, transfer=first.transfer_seconds,
                        kv_bytes=first.kv_bytes)
        req = worker_pb2.DecodeRequest(request_id=rid, first_token_id=first.first_token_id,
                                       params=params)
        return await self.stream(decode, req, start, sample)

    async def colocated(self, both: str, prompt: list[int], params) -> Sample:
        req = worker_pb2.DecodeRequest(request_id=self.rid(), prompt_token_ids=prompt,
                                       params=params)
        return await self.stream(both, req, time.perf_counter(), Sample(0, 0))


class Prompts:
    """Random prompts, never the same twice (no prefix-cache hits)."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.rng, self.vocab = random.Random(seed), vocab

    def __call__(self, length: int) -> list[int]:
        return [self.rng.randrange(LOW_TOKEN, self.vocab) for _ in range(length)]


async def run_disaggregated(prefill: str, decode: str, args, prompt: Prompts, params) -> dict:
    gw = Gateway()
    out = {}
    for transport in args.transports:
        await gw.disaggregated(prefill, decode, prompt(WARMUP_TOKENS), params, transport)
        for length in args.lengths:
            t = time.perf_counter()
            out[(f"disagg-{transport}", length)] = [
                await gw.disaggregated(prefill, decode, prompt(length), params, transport)
                for _ in range(args.requests)
            ]
            print(f"  disagg-{transport} {length}: {time.perf_counter() - t:.0f} s", flush=True)
    await gw.channels.close()
    return out


async def run_colocated(both: str, args, prompt: Prompts, params) -> dict:
    gw = Gateway()
    out = {}
    await gw.colocated(both, prompt(WARMUP_TOKENS), params)
    for length in args.lengths:
        t = time.perf_counter()
        out[("colocated", length)] = [await gw.colocated(both, prompt(length), params)
                                      for _ in range(args.requests)]
        print(f"  colocated {length}: {time.perf_counter() - t:.0f} s", flush=True)
    await gw.channels.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--transports", nargs="+", default=["grpc", "torch"],
                    choices=["grpc", "torch", "mooncake"])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from engine.config import ModelConfig
    from engine.loader.resolve import resolve_model_dir

    model_dir = resolve_model_dir(args.model)  # converts the GGUF once, before the workers
    prompt = Prompts(ModelConfig.from_dir(model_dir).vocab_size, args.seed)
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                            ignore_eos=True))
    model_args = ["--model", str(model_dir)]
    results: dict = {}

    print("disaggregated: 1 prefill + 1 decode worker", flush=True)
    with LocalCluster() as cluster:
        # mooncake needs its transfer engine on both workers (grpc stands in if it cannot start)
        moon = ["--transport", "mooncake,grpc"] if "mooncake" in args.transports else []
        prefill = cluster.start("prefill", [*model_args, *moon])
        decode = cluster.start("decode", [*model_args, *moon])
        results.update(asyncio.run(run_disaggregated(prefill.address, decode.address, args,
                                                     prompt, params)))
    print("colocated: 1 worker", flush=True)
    with LocalCluster() as cluster:
        both = cluster.start("both", model_args)
        results.update(asyncio.run(run_colocated(both.address, args, prompt, params)))

    med = statistics.median
    print(f"\n{model_dir.name}: medians of {args.requests} requests, {args.max_tokens} output "
          f"tokens each, one request at a time")
    head = (f"{'setup':>13} {'prompt':>6} | {'TTFT ms':>8} | {'prefill ms':>10} | "
            f"{'transfer ms':>11} | {'KV MiB':>7} | {'decode tok/s':>12}")
    print(head)
    print("-" * len(head))
    for setup in ["colocated", *(f"disagg-{t}" for t in args.transports)]:
        for length in args.lengths:
            s = results[(setup, length)]
            disagg = setup != "colocated"
            print(f"{setup:>13} {length:>6} | {med(x.ttft for x in s) * 1e3:>8.0f} | "
                  + (f"{med(x.prefill for x in s) * 1e3:>10.0f} | "
                     f"{med(x.transfer for x in s) * 1e3:>11.1f} | "
                     f"{med(x.kv_bytes for x in s) / 2**20:>7.1f} | " if disagg
                     else f"{'-':>10} | {'-':>11} | {'-':>7} | ")
                  + f"{med(x.decode_tps for x in s):>12.1f}")


if __name__ == "__main__":
    main()
