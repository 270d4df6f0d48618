"""Time to first token and decode speed, disaggregated against colocated.

    PYTHONPATH=. python benchmarks/disagg_latency.py [--lengths 128 512 2048] [--requests 4]
        [--max-tokens 16] [--transports grpc torch torch-layers mooncake mooncake-layers]
        [--model DIR_OR_GGUF] [--kv-cache-gib 0.5] [--no-pin]

The model is the bundled SmolLM2-135M unless --model says otherwise (its
GGUF is converted on the first start and cached). One cluster serves every
arm, and the arms take turns request by request (so a change in the
machine's load hits them alike; only one request runs at a time):

    colocated               1 worker with role "both"
    disagg-grpc/-torch      1 prefill + 1 decode worker, KV over the grpc
    /-mooncake              transport, torch.distributed (gloo on the CPU), or
                            the Mooncake engine (tcp; on a CPU one write when
                            the prompt is done, the default there)
    disagg-torch-layers     torch or mooncake, from a second prefill worker
    /-mooncake-layers       started with --kv-layer-writes on: each layer sent
                            while the later layers compute

Cores: as ``tandem up`` deals them, the prefill and the decode worker each
compute on their own half of the host's cores (``--cpu-cores``), and the
colocated worker on the prefill worker's half, so that a prompt computes on
the same cores in every arm and the TTFT difference is the handoff, not a
share of cores (--no-pin: every worker on every core, sharing them).

This process plays the gateway: Reserve -> Prefill -> Decode (the
gateway's order), or one Decode on the colocated worker. Prompts are
random token ids, a different prompt per request (no prefix-cache hits);
greedy, ignore_eos, ``--max-tokens`` output tokens each. A short warm-up
request per arm (first contact: channels, process group, preflight) is not
counted. Reservations get a long lease: a slow CPU prefill must not outlive it.

    TTFT         from the first call to the first token as the gateway sends
                 it: the Prefill reply carries it (disaggregated), the first
                 streamed token (colocated)
    overhead     TTFT against colocated's at the same length
    reserve      the Reserve call
    prefill      the Prefill call: prompt compute, KV transfer, acknowledgement
    transfer     of which the KV transfer (the prefill worker's own clock; it
                 starts with the compute when the transport streams)
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
TRANSPORTS = ["grpc", "torch", "torch-layers", "mooncake", "mooncake-layers"]


@dataclass
class Sample:
    ttft: float = 0.0
    decode_tps: float = float("nan")
    reserve: float = 0.0
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
        """Decode tok/s over the stream's tokens; the first one's time is the
        TTFT unless the Prefill reply set it."""
        times: list[float] = []
        async for chunk in self.stub(address).Decode(req):
            times += [time.perf_counter()] * len(chunk.token_ids)
        if not sample.ttft:
            sample.ttft = times[0] - start
        if len(times) > 1 and times[-1] > times[0]:
            sample.decode_tps = (len(times) - 1) / (times[-1] - times[0])
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
        done = time.perf_counter()
        # NOTE: as the gateway does: the first token goes to the client from
        # the Prefill reply, and the Decode stream continues after it.
        sample = Sample(ttft=done - start, reserve=t - start, prefill=done - t,
                        transfer=first.transfer_seconds, kv_bytes=first.kv_bytes)
        req = worker_pb2.DecodeRequest(request_id=rid, first_token_id=first.first_token_id,
                                       params=params, first_token_sent=True)
        return await self.stream(decode, req, done, sample)

    async def colocated(self, both: str, prompt: list[int], params) -> Sample:
        req = worker_pb2.DecodeRequest(request_id=self.rid(), prompt_token_ids=prompt,
                                       params=params)
        return await self.stream(both, req, time.perf_counter(), Sample())


class Prompts:
    """Random prompts, never the same twice (no prefix-cache hits)."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.rng, self.vocab = random.Random(seed), vocab

    def __call__(self, length: int) -> list[int]:
        return [self.rng.randrange(LOW_TOKEN, self.vocab) for _ in range(length)]


async def run(arms: dict, args, prompt: Prompts, params) -> dict:
    """``arms``: name -> coroutine function (Gateway, prompt) -> Sample."""
    gw = Gateway()
    out: dict = {}
    for call in arms.values():
        await call(gw, prompt(WARMUP_TOKENS))
    for length in args.lengths:
        t = time.perf_counter()
        for _ in range(args.requests):
            for name, call in arms.items():
                out.setdefault((name, length), []).append(await call(gw, prompt(length)))
        print(f"  {length} tokens: {time.perf_counter() - t:.0f} s", flush=True)
    await gw.channels.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--transports", nargs="+", default=["grpc", "torch"], choices=TRANSPORTS)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-gib", default="0.5",
                    help="each worker's KV cache (small: four workers share the host's memory)")
    ap.add_argument("--pin", default=True, action=argparse.BooleanOptionalAction,
                    help="prefill and decode workers on their own cores (default), the "
                         "colocated worker on the prefill worker's")
    args = ap.parse_args()

    from engine.config import ModelConfig
    from engine.loader.resolve import resolve_model_dir

    model_dir = resolve_model_dir(args.model)  # converts the GGUF once, before the workers
    prompt = Prompts(ModelConfig.from_dir(model_dir).vocab_size, args.seed)
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                            ignore_eos=True))
    model_args = ["--model", str(model_dir), "--kv-cache-gib", args.kv_cache_gib]
    mooncake = any(t.startswith("mooncake") for t in args.transports)
    # mooncake needs its transfer engine on both workers (grpc stands in if it cannot start)
    moon = ["--transport", "mooncake,grpc"] if mooncake else []

    from worker.cpu_cores import split_cores

    cores = split_cores(2) if args.pin else None
    if args.pin and cores is None:
        print("fewer than 2 cores: not pinned", flush=True)
    pin_prefill, pin_decode = (["--cpu-cores", c] for c in cores) if cores else ([], [])
    with LocalCluster() as cluster:
        both = cluster.start("both", [*model_args, *pin_prefill]).address
        prefill = cluster.start("prefill", [*model_args, *moon, *pin_prefill]).address
        decode = cluster.start("decode", [*model_args, *moon, *pin_decode]).address
        layers = any(t.endswith("-layers") for t in args.transports)
        by_layer = cluster.start("prefill", [*model_args, *moon, *pin_prefill,
                                             "--kv-layer-writes", "on"]
                                 ).address if layers else None

        def disagg(transport: str):
            worker = by_layer if transport.endswith("-layers") else prefill
            wire = transport.removesuffix("-layers")
            return lambda gw, p: gw.disaggregated(worker, decode, p, params, wire)

        arms = {"colocated": lambda gw, p: gw.colocated(both, p, params)}
        arms.update({f"disagg-{t}": disagg(t) for t in args.transports})
        print(f"{len(arms)} arms, taking turns: {', '.join(arms)}", flush=True)
        results = asyncio.run(run(arms, args, prompt, params))

    med = statistics.median
    print(f"\n{model_dir.name}: medians of {args.requests} requests, {args.max_tokens} output "
          f"tokens each, one request at a time; cores: "
          f"{f'prefill and colocated {cores[0]}, decode {cores[1]}' if cores else 'shared'}")
    head = (f"{'setup':>22} {'prompt':>6} | {'TTFT ms':>8} | {'overhead':>8} | "
            f"{'reserve ms':>10} | {'prefill ms':>10} | {'transfer ms':>11} | {'KV MiB':>7} | "
            f"{'decode tok/s':>12}")
    print(head)
    print("-" * len(head))
    for setup in arms:
        for length in args.lengths:
            s = results[(setup, length)]
            ttft = med(x.ttft for x in s)
            base = med(x.ttft for x in results[("colocated", length)])
            cells = [f"{ttft * 1e3:>8.0f}", f"{(ttft / base - 1) * 100:>+7.0f}%"]
            if setup == "colocated":
                cells += [f"{'-':>10}", f"{'-':>10}", f"{'-':>11}", f"{'-':>7}"]
            else:
                cells += [f"{med(x.reserve for x in s) * 1e3:>10.1f}",
                          f"{med(x.prefill for x in s) * 1e3:>10.0f}",
                          f"{med(x.transfer for x in s) * 1e3:>11.1f}",
                          f"{med(x.kv_bytes for x in s) / 2**20:>7.1f}"]
            cells.append(f"{med(x.decode_tps for x in s):>12.1f}")
            print(f"{setup:>22} {length:>6} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
