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

each at batch 1 (requests one after another) and batch 16 (16 requests at once). The two
engines run in lockstep, one step of each in turn, and each is timed by its own steps only,
so a change in the machine's load falls on both alike. For each: output tokens per second
of its steps' wall time, mean TPOT (per request: time from its first to its last token
over its tokens after the first, on the same clock), and with speculation the acceptance
rate (accepted / proposed tokens) and mean accepted length (tokens a verifying step yields
per sequence: 1 + accepted / proposals). Also CPU time per output token (the process's CPU
time in its steps): on a shared machine wall-clock numbers move with everyone else's load,
the CPU time a token costs much less (run with ``--threads 1`` so it is one core's work).
The lockstep run is repeated ``--repeat`` times; the run with the median CPU time per
token is reported for each arm. At batch 16 it also splits each arm's CPU per token
between the steps with the whole batch running and those with fewer (the tail, once some
requests finished). The output tokens with and without speculation are checked
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


class Arm:
    """One engine working through the prompts ``batch`` at a time, timed by its own steps
    only: ``clock`` and ``cpu`` add up the wall and CPU time of its steps, and token times
    are read on ``clock``, so arms that step in turn do not count each other's steps."""

    def __init__(self, llm: LLM, prompts: list[list[int]], batch: int, params: SamplingParams):
        self.engine, self.batch, self.params = llm.engine, batch, params
        self.queue = list(enumerate(prompts))
        self.clock = self.cpu = 0.0
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.tokens: dict[str, list[int]] = {}
        self.stats0 = self.engine.stats().spec_decode
        # [CPU seconds, tokens] of steps with the whole batch running, and with fewer.
        self.phases = {"full": [0.0, 0], "short": [0.0, 0]}
        self._seen: dict[str, int] = {}

    @property
    def done(self) -> bool:
        return not self.queue and not self.engine.has_unfinished_requests()

    def step(self) -> None:
        engine = self.engine
        if not engine.has_unfinished_requests():
            for i, prompt in self.queue[: self.batch]:
                engine.add_request(str(i), prompt, self.params)
            self.queue = self.queue[self.batch :]
        stats = engine.stats()
        phase = self.phases["full" if stats.num_running + stats.num_waiting >= self.batch
                            else "short"]
        w, c = time.perf_counter(), time.process_time()
        outs = engine.step()
        self.clock += time.perf_counter() - w
        self.cpu += time.process_time() - c
        phase[0] += time.process_time() - c
        for out in outs:
            rid = out.request_id
            phase[1] += len(out.outputs[0].token_ids) - self._seen.get(rid, 0)
            self._seen[rid] = len(out.outputs[0].token_ids)
            if out.outputs[0].token_ids:
                self.first.setdefault(rid, self.clock)
                self.last[rid] = self.clock
            if out.finished:
                self.tokens[rid] = out.outputs[0].token_ids

    def result(self) -> dict:
        num_tokens = sum(len(t) for t in self.tokens.values())
        tpots = [(self.last[r] - self.first[r]) / (len(t) - 1)
                 for r, t in self.tokens.items() if len(t) > 1]
        return {"tokens": self.tokens, "throughput": num_tokens / self.clock,
                "cpu_ms_per_token": 1000 * self.cpu / num_tokens,
                "tpot_ms": 1000 * sum(tpots) / len(tpots), "num_tokens": num_tokens,
                "stats": (self.stats0, self.engine.stats().spec_decode),
                "phases": {k: 1000 * cpu / n if n else None for k, (cpu, n) in
                           self.phases.items()},
                "short_tokens": self.phases["short"][1]}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def run(llms: dict[str, LLM], prompts: list[list[int]], batch: int,
        params: SamplingParams) -> dict[str, dict]:
    """All arms in lockstep: one step of each in turn until every arm is done."""
    arms = {name: Arm(llm, prompts, batch, params) for name, llm in llms.items()}
    while not all(a.done for a in arms.values()):
        for arm in arms.values():
            if not arm.done:
                arm.step()
    return {name: arm.result() for name, arm in arms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch1-requests", type=int, default=4)
    ap.add_argument("--batch16-requests", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3,
                    help="lockstep runs of both arms; the run with the median CPU time per "
                         "token is reported for each (the machine may be shared)")
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
            warm = SamplingParams(temperature=0, max_tokens=4)
            run(llms, prompts[:1], 1, warm)
            runs = [run(llms, prompts, batch, params) for _ in range(args.repeat)]
            results: dict[str, dict] = {}
            for name in llms:
                by_cpu = sorted((r[name] for r in runs), key=lambda r: r["cpu_ms_per_token"])
                res = results[name] = by_cpu[len(by_cpu) // 2]
                before, after = res["stats"]
                acc = mal = "-"
                if after is not None:
                    drafts = after.num_drafts - before.num_drafts
                    proposed = after.num_draft_tokens - before.num_draft_tokens
                    accepted = after.num_accepted_tokens - before.num_accepted_tokens
                    acc = f"{accepted / proposed:.2f}" if proposed else "n/a"
                    mal = f"{1 + accepted / drafts:.2f}" if drafts else "n/a"
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
            each = ", ".join(f"x{r['off']['cpu_ms_per_token'] / r['ngram']['cpu_ms_per_token']:.2f}"
                             for r in runs)
            print(f"CPU per token off/ngram in each run: {each}", flush=True)
            if batch > 1:  # where a closed batch's cost goes (docs/benchmarks.md)
                print("CPU ms/token with the whole batch running / fewer (tokens then): "
                      + ", ".join(f"{name} {_ms(r['phases']['full'])} / "
                                  f"{_ms(r['phases']['short'])} ({r['short_tokens']})"
                                  for name, r in results.items()), flush=True)
    print(f"load average after: {os.getloadavg()}")
    for kind, costs in llms["ngram"].engine.spec.cost.snapshot().items():
        print(f"step costs the ngram engine measured, {kind} steps, ms by rows: "
              + ", ".join(f"{rows}: {1000 * t:.0f}" for rows, t in costs.items()))


if __name__ == "__main__":
    main()
