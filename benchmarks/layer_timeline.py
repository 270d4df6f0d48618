"""A timeline of one prompt's KV sent layer by layer while it computes.

    PYTHONPATH=. python benchmarks/layer_timeline.py [--prompt-len 512] [--model DIR_OR_GGUF]
        [--transport mooncake|torch]

A prefill worker with ``--kv-layer-writes on`` and a decode worker (mooncake
over TCP, or torch over gloo), both writing their spans to one trace file;
this process plays the gateway for one warm-up and one measured request.
From the measured request's trace it prints, per layer and per prompt
chunk, when the layer computed (``prefill.layer``) and when its KV was sent
(``kv_transfer.layer_write`` for mooncake, ``kv_transfer.layer_send`` for
torch), in ms from the start of the transfer's span, and how much of the
sending happened while later layers computed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sampling_params import SamplingParams  # noqa: E402
from rpc.convert import params_to_proto  # noqa: E402
from rpc.pool import ChannelPool  # noqa: E402
from rpc.protos import worker_pb2, worker_pb2_grpc  # noqa: E402
from rpc.tracing import read_trace_file  # noqa: E402
from tandem.cluster import LocalCluster  # noqa: E402


async def one(prefill: str, decode: str, rid: str, prompt: list[int], params,
              transport: str) -> None:
    channels = ChannelPool()
    stub = lambda a: worker_pb2_grpc.WorkerStub(channels.get(a))  # noqa: E731
    ticket = (await stub(decode).Reserve(worker_pb2.ReserveRequest(
        request_id=rid, prompt_token_ids=prompt, params=params, lease_ms=600_000))).ticket
    first = await stub(prefill).Prefill(worker_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=params, ticket=ticket,
        transport=transport))
    async for _ in stub(decode).Decode(worker_pb2.DecodeRequest(
            request_id=rid, first_token_id=first.first_token_id, params=params,
            first_token_sent=True)):
        pass
    await channels.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--transport", default="mooncake", choices=["mooncake", "torch"])
    args = ap.parse_args()
    span_name = {"mooncake": "kv_transfer.layer_write", "torch": "kv_transfer.layer_send"}[
        args.transport]

    from engine.config import ModelConfig
    from engine.loader.resolve import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    rng = random.Random(0)
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    common = ["--model", str(model_dir), "--kv-cache-gib", "0.5", "--transport",
              f"{args.transport},grpc"]
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "spans.jsonl"
        with LocalCluster(env={"TANDEM_TRACE_FILE": str(trace)}) as cluster:
            prefill = cluster.start("prefill", [*common, "--kv-layer-writes", "on"])
            decode = cluster.start("decode", common)
            for rid in ("warm-up", "measured"):
                prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
                asyncio.run(one(prefill.address, decode.address, rid, prompt, params,
                                args.transport))
            time.sleep(1.0)  # the exporters write finished spans as they end
        spans = read_trace_file(trace)
    send = next(s for s in spans if s["name"] == "kv_transfer.send"
                and s["attributes"].get("request_id") == "measured")
    mine = [s for s in spans if s["trace_id"] == send["trace_id"]]
    t0 = send["start"]
    computed = sorted((s for s in mine if s["name"] == "prefill.layer"), key=lambda s: s["start"])
    written = sorted((s for s in mine if s["name"] == span_name),
                     key=lambda s: s["start"])

    def ms(t: int) -> float:
        return (t - t0) / 1e6

    print(f"{args.prompt_len}-token prompt, {len(computed)} layer computes, "
          f"{len(written)} layer sends ({args.transport}); ms from the transfer's start")
    print(f"{'layer':>5} | {'computed':>17} | {'sent':>17} | blocks | KiB")
    for c in computed:
        layer = c["attributes"]["layer"]
        w = next((x for x in written if x["attributes"]["layer"] == layer
                  and x["start"] >= c["end"]), None)
        if w is not None:
            written.remove(w)
        cells = (f"{ms(w['start']):7.1f} - {ms(w['end']):7.1f} | "
                 f"{w['attributes']['blocks_upto']:>6} | {w['attributes']['bytes'] // 1024:>4}"
                 if w else f"{'-':>17} |")
        print(f"{layer:>5} | {ms(c['start']):7.1f} - {ms(c['end']):7.1f} | {cells}")
    last_compute = max(c["end"] for c in computed)
    writes = [s for s in mine if s["name"] == span_name]
    busy = sum(s["end"] - s["start"] for s in writes)
    before = sum(max(0, min(s["end"], last_compute) - s["start"]) for s in writes)
    print(f"sending took {busy / 1e6:.1f} ms in all, {before / max(busy, 1):.0%} of it before "
          f"the last layer had computed; the transfer ended "
          f"{(send['end'] - last_compute) / 1e6:.1f} ms after it")


if __name__ == "__main__":
    main()
