"""A short request behind one long prompt, served: through the gateway, colocated and 1P+1D.

    PYTHONPATH=. python benchmarks/long_prompt_served.py [--long 8000] [--short 32]
        [--rounds 3] [--setups colocated always auto] [--delay 0.5] [--dtype auto]

``benchmarks/long_prompt_ttft.py`` measures this in one engine; here each
setup is a ``tandem up`` cluster (the bundled SmolLM2-135M-Instruct, the
gateway's embedded state store), so the long prompt's chunks on a prefill
worker, its KV handoff and the gateway's routing are all in the way:

    colocated   ``tandem up --prefill 0 --decode 1``
    always      ``tandem up --prefill 1 --decode 1 --disagg-policy always``:
                both prompts compute on the prefill worker, where the short
                one must get into the long one's chunked steps
    auto        the same cluster under ``--disagg-policy auto``

Each round streams a long random-token prompt over ``/v1/completions``,
waits ``--delay`` seconds (the long prompt is then computing), and streams a
short one; both greedy, ``ignore_eos``, ``--max-tokens`` tokens. The short
request's TTFT is from its own send; the long one's from its send. Fresh
prompts every round (no prefix-cache hits); a short warm-up request per
setup is not counted. The setups run one after another, never two at once.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from procs import stop_group  # noqa: E402
from serving import wait_ready  # noqa: E402

from tandem.bench.clients import OpenAIClient  # noqa: E402
from tandem.bench.datasets import FIRST_PLAIN_TOKEN, BenchRequest  # noqa: E402
from tandem.cluster import free_port  # noqa: E402

HOST = "127.0.0.1"
SETUPS = {
    "colocated": ["--prefill", "0", "--decode", "1"],
    "always": ["--prefill", "1", "--decode", "1", "--disagg-policy", "always"],
    "auto": ["--prefill", "1", "--decode", "1", "--disagg-policy", "auto"],
}


def request(rng: random.Random, vocab: int, length: int, max_tokens: int) -> BenchRequest:
    ids = tuple(rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(length))
    return BenchRequest(ids, length, max_tokens)


async def rounds(url: str, model: str, args, vocab: int) -> list[tuple[float, float]]:
    """(short TTFT, long TTFT) in seconds, one pair a round."""
    rng = random.Random(args.seed)
    client = OpenAIClient(url, model, None, 0.0, True, timeout_s=900.0)
    try:
        warm = await client.send(request(rng, vocab, 16, 2))
        if not warm.ok:
            raise RuntimeError(f"warm-up failed: {warm.error}")
        out = []
        for _ in range(args.rounds):
            long = asyncio.create_task(
                client.send(request(rng, vocab, args.long, args.max_tokens)))
            await asyncio.sleep(args.delay)
            short = await client.send(request(rng, vocab, args.short, args.max_tokens))
            long_rec = await long
            for name, rec in (("short", short), ("long", long_rec)):
                if not rec.ok:
                    raise RuntimeError(f"the {name} request failed: {rec.error}")
            out.append((short.ttft, long_rec.ttft))
            print(f"    short {short.ttft:6.2f} s, long {long_rec.ttft:6.2f} s", flush=True)
        return out
    finally:
        await client.close()


def run_setup(name: str, args, model_dir: Path, vocab: int, log_dir: Path):
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("tandem")), "up", *SETUPS[name],
           "--model", str(model_dir), "--host", HOST, "--port", str(port),
           "--grpc-port", str(free_port()), "--dtype", args.dtype]
    log = log_dir / f"{name}.log"
    print(f"{name}: {' '.join(cmd[1:])}  (log {log})", flush=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            url = f"http://{HOST}:{port}"
            model = wait_ready(url, proc, 300.0)
            if model is None:
                raise RuntimeError(f"{name} did not come up; see {log}")
            return asyncio.run(rounds(url, model, args, vocab))
        finally:
            stop_group(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", type=int, default=8000)
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.5,
                    help="seconds between sending the long prompt and the short one")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from engine.config import ModelConfig
    from engine.loader.resolve import resolve_model_dir

    model_dir = resolve_model_dir(None)  # converts the bundled GGUF once, before any cluster
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    log_dir = Path(tempfile.mkdtemp(prefix="long-prompt-served-"))
    results = {name: run_setup(name, args, model_dir, vocab, log_dir) for name in args.setups}

    med = statistics.median
    print(f"\n{args.short}-token request sent {args.delay} s after a {args.long}-token one, "
          f"{args.max_tokens} output tokens each, dtype {args.dtype}; medians of "
          f"{args.rounds} rounds (each round's in brackets)")
    print(f"{'setup':>10} | {'short TTFT s':>12} | {'long TTFT s':>11}")
    for name, pairs in results.items():
        shorts = ", ".join(f"{s:.2f}" for s, _ in pairs)
        print(f"{name:>10} | {med(s for s, _ in pairs):>12.2f} | "
              f"{med(t for _, t in pairs):>11.2f}   ({shorts})")


if __name__ == "__main__":
    main()
