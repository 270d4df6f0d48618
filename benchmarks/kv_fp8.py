"""SmolLM2-135M with an fp8 KV cache against its bfloat16 cache: how far the
output drifts, and how many more blocks and requests the same bytes hold.

    PYTHONPATH=. python benchmarks/kv_fp8.py [--max-tokens 32] [--kv-cache-mib 64]

For each cache dtype (auto = bfloat16, fp8_e4m3, fp8_e5m2), on the bundled
model in bfloat16:

* greedy agreement: eight fixed prompts run greedily; per prompt, how many
  leading tokens equal the bfloat16 cache's, and how many prompts match fully;
* mean |Δ logprob|: the bfloat16 cache's prompt + output, scored teacher-
  forced (prompt_logprobs) under each cache in chunks of 16 tokens, so most
  positions attend to keys and values read back from the cache; the mean over
  every position of |logprob(fp8) - logprob(bf16)| of the actual next token;
* memory: blocks in ``--kv-cache-mib`` of cache, the most requests of
  ``max_model_len`` tokens that fit at once, and ``vllm:kv_cache_usage_perc``
  (the engine's ``kv_usage``) with all eight prompts running;
* decode speed: output tokens per second of the greedy batch (on the CPU an
  fp8 cache goes through the torch reference, not the C kernel).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fidelity import PROMPTS as ALL_PROMPTS  # noqa: E402
from fidelity import leading_matches  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402

PROMPTS = ALL_PROMPTS


def run(kv: str, args) -> dict:
    llm = LLM(dtype="bfloat16", kv_cache_dtype=kv, kv_cache_bytes=args.kv_cache_mib << 20,
              max_model_len=args.max_model_len, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    engine = llm.engine
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, p in enumerate(ids):
        engine.add_request(f"g{i}", p, greedy)
    peak, tokens, t0 = 0.0, 0, time.perf_counter()
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
        peak = max(peak, engine.stats().kv_usage)
    seconds = time.perf_counter() - t0
    tokens = sum(len(v) for v in outs.values())
    return {
        "llm": llm, "ids": ids, "outputs": [outs[f"g{i}"] for i in range(len(ids))],
        "num_blocks": engine.stats().num_blocks, "peak_usage": peak,
        "max_concurrency": engine.stats().num_blocks * engine.block_size // args.max_model_len,
        "tok_s": tokens / seconds,
    }


def scored(llm: LLM, sequences: list[list[int]]) -> list[list[float]]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(sequences, params, use_tqdm=False)
    # Each entry maps the actual token first, then the top alternatives.
    return [[next(iter(e.values())) for e in o.prompt_logprobs[1:]] for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache-mib", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args()
    # Prefix caching would serve the scoring pass from the greedy run's blocks.
    results = {kv: run(kv, args) for kv in ("auto", "fp8_e4m3", "fp8_e5m2")}
    base = results["auto"]
    full = [i + o for i, o in zip(base["ids"], base["outputs"])]
    base_lp = scored(base["llm"], full)
    print(f"{'kv cache':10} {'blocks':>7} {'max conc':>9} {'peak usage':>11} "
          f"{'same outputs':>13} {'leading tokens':>15} {'mean |dlogprob|':>16} {'tok/s':>7}")
    for kv, r in results.items():
        lead = [leading_matches(a, b) for a, b in zip(r["outputs"], base["outputs"])]
        same = sum(n == args.max_tokens for n in lead)
        lp = scored(r["llm"], full) if kv != "auto" else base_lp
        deltas = [abs(a - b) for x, y in zip(lp, base_lp) for a, b in zip(x, y)]
        print(f"{kv:10} {r['num_blocks']:>7} {r['max_concurrency']:>9} "
              f"{r['peak_usage']:>10.1%} {same:>6}/{len(lead):<6} "
              f"{sum(lead) / len(lead):>8.1f}/{args.max_tokens:<6} "
              f"{sum(deltas) / len(deltas):>16.4f} {r['tok_s']:>7.1f}")


if __name__ == "__main__":
    main()
