"""Speculative decoding (n-gram) on SmolLM2-135M, offline: acceptance, TPOT, throughput.

    PYTHONPATH=. python benchmarks/spec_decode.py [--k 4] [--max-tokens 96] [--dtype float32]

Workloads of chat prompts, run with and without ``{"method": "ngram"}``:

    hit      greedy, "Repeat this text exactly: ..." over different passages: the output
             copies the prompt, so prompt lookups hit
    open     greedy, open-ended requests (a story, a list, an explanation); SmolLM2-135M
             repeats itself a lot at temperature 0, so lookups hit here too
    no-hit   the open-ended requests sampled (temperature 0.8 as through the gateway,
             unseeded, ``ignore_eos`` so every request has max_tokens tokens): little
             repeats, lookups fire now and then and their guesses mostly fail

each at batch 1 (requests one after another) and batch 16 (16 requests at once). For each:
output tokens per second of wall time, mean TPOT (per request: time from its first to its
last token over its tokens after the first), and with speculation the acceptance rate
(accepted / proposed tokens) and mean accepted length (tokens a verifying step yields per
sequence: 1 + accepted / proposals). Also CPU time per output token (the process's CPU time
over the run): on a shared machine wall-clock numbers move with everyone else's load, the
CPU time a token costs much less (run with ``--threads 1`` so it is one core's work).
Each arm runs ``--repeat`` times, alternating with the other; the run with the median CPU
time per token is reported. The output tokens with and without speculation are checked
equal (greedy). The load average is printed: the machine may be shared. After the table,
the step costs the speculating engine measured (engine/spec_decode/cost.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402

PASSAGES = [
    "The river bends twice before it reaches the old mill, where the water slows and turns green.",
    "Every morning the baker opens the shop at six, sets out the bread, and writes the prices "
    "on a small blackboard by the door.",
    "To install the tool, download the archive, unpack it into a folder of your choice, and add "
    "that folder to your PATH.",
    "The committee met on Tuesday and agreed to postpone the vote until the budget report is "
    "finished and shared with every member.",
    "Light from the nearest star takes a little over four years to reach us, so we always see "
    "it as it was, never as it is.",
    "Please remember to water the plants on the balcony, feed the cat twice a day, and lock the "
    "back door before you leave.",
    "The first version of the program was slow because it read the whole file into memory "
    "before processing a single line.",
    "Our train leaves the central station at nine fifteen and arrives in the mountains shortly "
    "after noon, if the weather holds.",
]
TOPICS = [
    "Write a short story about a lighthouse keeper.", "List five uses of a paperclip.",
    "Explain how a bicycle gear works.", "Describe your ideal weekend.",
    "Give advice to someone learning to cook.", "Write a poem about autumn rain.",
    "Explain why the sky is blue.", "Describe a busy market in the morning.",
]


def chats(kind: str, num: int) -> list[list[dict[str, str]]]:
    if kind == "hit":
        texts = [f"Repeat this text exactly: {PASSAGES[i % len(PASSAGES)]} "
                 f"{PASSAGES[(i + 3) % len(PASSAGES)]}" for i in range(num)]
    else:  # open, no-hit
        texts = [TOPICS[i % len(TOPICS)] for i in range(num)]
    return [[{"role": "user", "content": t}] for t in texts]


def run(llm: LLM, prompts: list[list[int]], batch: int, params: SamplingParams) -> dict:
    """Requests ``batch`` at a time; per-request first and last token times."""
    engine = llm.engine
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    for lo in range(0, len(prompts), batch):
        for i in range(lo, min(lo + batch, len(prompts))):
            engine.add_request(str(i), prompts[i], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                rid = out.request_id
                if out.outputs[0].token_ids:
                    first.setdefault(rid, now)
                    last[rid] = now
                if out.finished:
                    tokens[rid] = out.outputs[0].token_ids
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    num_tokens = sum(len(t) for t in tokens.values())
    tpots = [(last[r] - first[r]) / (len(tokens[r]) - 1) for r in tokens if len(tokens[r]) > 1]
    return {"wall": wall, "tokens": tokens, "throughput": num_tokens / wall,
            "cpu_ms_per_token": 1000 * cpu / num_tokens,
            "tpot_ms": 1000 * sum(tpots) / len(tpots), "num_tokens": num_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch1-requests", type=int, default=4)
    ap.add_argument("--batch16-requests", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each arm, alternating off/ngram; the run with the median CPU "
                         "time per token is reported (the machine may be shared)")
    ap.add_argument("--no-hit-temperature", type=float, default=0.8)
    ap.add_argument("--workloads", default="hit,open,no-hit")
    ap.add_argument("--batches", default="1,16", help="which of batch 1 and batch 16 to run")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llms = {"off": LLM(dtype=args.dtype), "ngram": LLM(dtype=args.dtype, speculative_config=spec)}
    tok = llms["off"].get_tokenizer()
    print(f"load average before: {os.getloadavg()}  torch threads: "
          f"{torch.get_num_threads()}  cpus: {os.cpu_count()}")
    print("| workload | batch | spec | out tok/s | TPOT ms | CPU ms/token | acceptance "
          "| mean accepted len |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in args.workloads.split(","):
        # Unseeded, as most served traffic (a seeded request decides alike).
        params = SamplingParams(temperature=args.no_hit_temperature, max_tokens=args.max_tokens,
                                ignore_eos=True) if kind == "no-hit" else greedy
        for batch, num in ((1, args.batch1_requests), (16, args.batch16_requests)):
            if str(batch) not in args.batches.split(","):
                continue
            prompts = [tok.encode_chat(c, True) for c in chats(kind, num)]
            results: dict[str, dict] = {}
            for llm in llms.values():
                run(llm, prompts[:1], 1, SamplingParams(temperature=0, max_tokens=4))  # warm-up
            runs: dict[str, list] = {name: [] for name in llms}
            for _ in range(args.repeat):
                for name, llm in llms.items():
                    before = llm.engine.stats().spec_decode
                    res = run(llm, prompts, batch, params)
                    runs[name].append((res, before, llm.engine.stats().spec_decode))
            for name in llms:
                by_cpu = sorted(runs[name], key=lambda r: r[0]["cpu_ms_per_token"])
                res, before, after = by_cpu[len(by_cpu) // 2]
                acc = mal = "-"
                if after is not None:
                    drafts = after.num_drafts - before.num_drafts
                    proposed = after.num_draft_tokens - before.num_draft_tokens
                    accepted = after.num_accepted_tokens - before.num_accepted_tokens
                    acc = f"{accepted / proposed:.2f}" if proposed else "n/a"
                    mal = f"{1 + accepted / drafts:.2f}" if drafts else "n/a"
                results[name] = res
                print(f"| {kind} | {batch} | {name} | {res['throughput']:.1f} | "
                      f"{res['tpot_ms']:.1f} | {res['cpu_ms_per_token']:.1f} | {acc} | {mal} |",
                      flush=True)
            same = results["off"]["tokens"] == results["ngram"]["tokens"] if kind != "no-hit" \
                else "n/a (sampled)"
            speedup = results["ngram"]["throughput"] / results["off"]["throughput"]
            cpu = results["off"]["cpu_ms_per_token"] / results["ngram"]["cpu_ms_per_token"]
            print(f"| {kind} | {batch} | ngram/off | x{speedup:.2f} | "
                  f"x{results['off']['tpot_ms'] / results['ngram']['tpot_ms']:.2f} | x{cpu:.2f} "
                  f"| outputs equal: {same} | |", flush=True)
    print(f"load average after: {os.getloadavg()}")
    for kind, costs in llms["ngram"].engine.spec.cost.snapshot().items():
        print(f"step costs the ngram engine measured, {kind} steps, ms by rows: "
              + ", ".join(f"{rows}: {1000 * t:.0f}" for rows, t in costs.items()))


if __name__ == "__main__":
    main()
