"""Per-step cost of grammar token masks on this CPU: xgrammar against
llguidance, SmolLM2's tokenizer (vocab 49152), one JSON schema.

Each of ``batch`` matchers walks the tokens of the same valid document; a
step fills the whole batch's bitmask (each library's batched, multi-threaded
call) and then advances every matcher by its token. Reported per step:
compile time once, then mean/p50/p90 of the mask fill and of the advance.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/structured_masks.py --batch 1 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from engine.loader.resolve import resolve_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
            "tags": ["math", "engines", "poetry"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
            "role": "admin"}


def _stats(samples: list[float]) -> str:
    ms = sorted(s * 1e3 for s in samples)
    p90 = ms[int(0.9 * (len(ms) - 1))]
    return f"mean {statistics.fmean(ms):.3f}  p50 {statistics.median(ms):.3f}  p90 {p90:.3f} ms"


def bench_llguidance(tokenizer_path: str, tokens: list[int], batch: int, threads: int) -> None:
    import llguidance
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_path)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False})
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(batch)]
    t2 = time.perf_counter()
    if matchers[0].is_error():
        raise RuntimeError(matchers[0].get_error())
    executor = llguidance.LLExecutor(threads)
    mask = lnp.allocate_token_bitmask(batch, tok.vocab_size)
    fill, advance = [], []
    for token in tokens:
        a = time.perf_counter()
        lnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
        b = time.perf_counter()
        ok = [m.consume_token(token) for m in matchers]
        c = time.perf_counter()
        if not all(ok):
            raise RuntimeError(f"llguidance rejected token {token}: {matchers[0].get_error()}")
        fill.append(b - a)
        advance.append(c - b)
    print(f"llguidance  batch {batch:2d}: tokenizer {1e3 * (t1 - t0):.0f} ms, "
          f"grammar x{batch} {1e3 * (t2 - t1):.1f} ms; per step fill {_stats(fill)}; "
          f"advance {_stats(advance)}")


def bench_xgrammar(tokenizer_path: str, tokens: list[int], batch: int, threads: int) -> None:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_path)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=hf.vocab_size, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, max_threads=threads)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                           separators=(",", ":"))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    t2 = time.perf_counter()
    batcher = xgr.BatchGrammarMatcher(threads)
    mask = xgr.allocate_token_bitmask(batch, info.vocab_size).numpy()
    fill, advance = [], []
    for token in tokens:
        a = time.perf_counter()
        batcher.batch_fill_next_token_bitmask(matchers, mask)
        b = time.perf_counter()
        ok = [m.accept_token(token) for m in matchers]
        c = time.perf_counter()
        if not all(ok):
            raise RuntimeError(f"xgrammar rejected token {token}")
        fill.append(b - a)
        advance.append(c - b)
    print(f"xgrammar    batch {batch:2d}: tokenizer+compiler {1e3 * (t1 - t0):.0f} ms, "
          f"grammar+{batch} matchers {1e3 * (t2 - t1):.1f} ms; per step fill {_stats(fill)}; "
          f"advance {_stats(advance)}")


def bench_apply(batch: int, vocab: int, reps: int = 50) -> None:
    """Tandem's side of a step: unpack the bitmask to [batch, vocab] bools and
    mask the float32 logits with it (engine/structured_output/matchers.py)."""
    import torch

    from engine.structured_output.matchers import banned_tokens

    mask = np.random.default_rng(0).integers(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32),
                                             dtype=np.int64).astype(np.int32)
    logits = torch.randn(batch, vocab)
    unpack, fill = [], []
    for _ in range(reps):
        a = time.perf_counter()
        banned = banned_tokens(mask, vocab)
        b = time.perf_counter()
        logits.masked_fill(banned, float("-inf"))
        unpack.append(b - a)
        fill.append(time.perf_counter() - b)
    print(f"apply       batch {batch:2d} ({torch.get_num_threads()} torch threads): "
          f"unpack {_stats(unpack)}; masked_fill {_stats(fill)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--libs", nargs="+", default=["llguidance", "xgrammar"])
    parser.add_argument("--torch-threads", type=int, default=None)
    args = parser.parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    path = str(resolve_model_dir(None) / "tokenizer.json")
    from tokenizers import Tokenizer

    text = json.dumps(DOCUMENT, separators=(",", ":"))
    tokens = Tokenizer.from_file(path).encode(text, add_special_tokens=False).ids
    print(f"document: {len(tokens)} tokens; threads {args.threads}; np {np.__version__}")
    for batch in args.batch:
        bench_apply(batch, 49152)
        for lib in args.libs:
            fn = bench_llguidance if lib == "llguidance" else bench_xgrammar
            fn(path, tokens, batch, args.threads)


if __name__ == "__main__":
    main()
