"""``tandem bench``: the metrics' arithmetic on streams with known timings,
reproducible request streams, and small real runs of ``bench serve`` and
``bench compare`` (a few requests on a tiny model; speed is not checked)."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time

import httpx
import pytest

from tandem.bench.arrivals import arrival_offsets, parse_rates
from tandem.bench.clients import OpenAIClient
from tandem.bench.compare import comparison_table, gate_mismatch, parse_arms
from tandem.bench.datasets import (
    FIRST_PLAIN_TOKEN,
    BenchRequest,
    mixed_requests,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
    stream_hash,
)
from tandem.bench.metrics import RequestRecord, compute_metrics, parse_slos, percentile
from tandem.bench.runner import run_stream
from tandem.cli import main


def record(start, chunks, end, tokens=None, prompt_len=10, usage=None):
    return RequestRecord(prompt_len=prompt_len, start=start, end=end, chunk_times=list(chunks),
                         chunk_tokens=list(tokens or [1] * len(chunks)), usage_tokens=usage)


# ---- metrics -------------------------------------------------------------------------


def test_per_request_definitions():
    # Sent at 1.0; chunks at 1.5 (1 token), 1.7 (1), 2.3 (3 tokens); ends at 2.4.
    r = record(1.0, [1.5, 1.7, 2.3], 2.4, tokens=[1, 1, 3])
    assert r.output_tokens == 5
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.4)
    assert r.tpot == pytest.approx((1.4 - 0.5) / 4)
    # A chunk of k tokens contributes its gap / k, k times.
    assert r.itls == pytest.approx([0.2, 0.2, 0.2, 0.2])
    # The server's usage count wins over the chunk count.
    assert record(0.0, [0.1], 0.2, usage=7).output_tokens == 7
    # One output token: no TPOT.
    assert record(0.0, [0.1], 0.2).tpot is None


def test_percentiles_interpolate_like_numpy():
    xs = [40.0, 10.0, 30.0, 20.0]
    assert percentile(xs, 50) == 25.0
    assert percentile(xs, 90) == pytest.approx(37.0)  # rank 2.7: 30 + 0.7 * 10
    assert percentile(xs, 99) == pytest.approx(39.7)
    assert percentile([5.0], 99) == 5.0


def test_aggregate_metrics_on_known_timings():
    records = [
        record(0.0, [0.1, 0.2, 0.3], 0.3, prompt_len=4),   # ttft 100, tpot 100, e2e 300
        record(0.0, [0.2, 0.6], 0.6, prompt_len=6),        # ttft 200, tpot 400, e2e 600
        record(1.0, [1.4, 1.5, 1.6, 1.7], 1.9, prompt_len=10),  # ttft 400, tpot 166.7
        RequestRecord(prompt_len=99, start=0.0, end=0.1, error="HTTP 500"),
    ]
    m = compute_metrics(records, duration_s=2.0, slos_ms={"ttft": 250, "tpot": 150})
    assert (m.completed, m.failed) == (3, 1)
    assert (m.input_tokens, m.output_tokens) == (20, 9)
    assert m.request_throughput == 1.5
    assert m.output_throughput == 4.5
    assert m.total_token_throughput == 14.5
    assert m.goodput == 0.5  # only the first meets both SLOs
    assert m.ttft.mean == pytest.approx(700 / 3)
    assert m.ttft.median == pytest.approx(200)
    assert m.ttft.p90 == pytest.approx(360)
    assert m.tpot.median == pytest.approx(500 / 3)
    assert m.e2e.mean == pytest.approx((300 + 600 + 900) / 3)
    # ITLs: 100, 100 | 400 | 100, 100, 100 (ms)
    assert m.itl.mean == pytest.approx(900 / 6)
    assert m.itl.median == pytest.approx(100)
    assert m.itl.p99 == pytest.approx(385)  # rank 4.95 of 6: 100 + 0.95 * 300
    assert compute_metrics(records, 2.0).goodput is None


def test_goodput_slo_parsing():
    assert parse_slos(["ttft:500", "tpot:50", "e2el:2000"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    for bad in (["ttft=5"], ["itl:5"], ["ttft:x"], ["tpot:0"]):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_openai_client_records_a_stream_with_known_timings():
    """A fake server: first token after 150 ms, then 50 ms apart; an empty
    chunk (held-back text) counts as no token."""
    delays = [(0.15, "a"), (0.05, ""), (0.05, "b"), (0.05, "c")]

    async def body():
        for delay, text in delays:
            await asyncio.sleep(delay)
            yield f'data: {json.dumps({"choices": [{"text": text}]})}\n\n'.encode()
        usage = {"choices": [], "usage": {"completion_tokens": 4}}
        yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()

    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    async def go():
        client = OpenAIClient("http://fake", "m", None, 0.0, True, 10.0,
                              transport=httpx.MockTransport(handler))
        try:
            return await client.send(BenchRequest((5, 6, 7), 3, 4))
        finally:
            await client.close()

    r = asyncio.run(go())
    assert seen["prompt"] == [5, 6, 7] and seen["max_tokens"] == 4 and seen["ignore_eos"]
    assert r.ok and r.text == "abc" and r.output_tokens == 4
    assert len(r.chunk_times) == 3
    assert 0.145 <= r.ttft < 0.15 + 1.0  # the lower bound is exact; the upper, load
    gaps = r.itls
    assert gaps[0] >= 0.095 and gaps[1] >= 0.045  # the empty chunk is no token
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 3)


# ---- request streams -----------------------------------------------------------------


def test_random_dataset_is_deterministic_and_in_range():
    a = random_requests(20, 100, 50, range_ratio=0.2, vocab_size=1000, seed=7)
    assert stream_hash(a) == stream_hash(random_requests(20, 100, 50, 0.2, 1000, seed=7))
    assert stream_hash(a) != stream_hash(random_requests(20, 100, 50, 0.2, 1000, seed=8))
    for r in a:
        assert 80 <= r.prompt_len <= 120 and 40 <= r.output_len <= 60
        assert len(r.prompt) == r.prompt_len
        assert all(FIRST_PLAIN_TOKEN <= t < 1000 for t in r.prompt)
    fixed = random_requests(3, 16, 8, 0.0, seed=0)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(16, 8)] * 3


def test_mixed_dataset_has_its_share_of_long_prompts():
    reqs = mixed_requests(200, short_len=16, long_len=400, long_fraction=0.25, output_len=8,
                          vocab_size=1000, seed=3)
    long = [r for r in reqs if r.prompt_len == 400]
    assert all(r.prompt_len in (16, 400) and len(r.prompt) == r.prompt_len for r in reqs)
    assert 30 <= len(long) <= 70 and all(r.output_len == 8 for r in reqs)
    assert stream_hash(reqs) == stream_hash(mixed_requests(200, 16, 400, 0.25, 8, 0.0, 1000, 3))
    assert all(r.prompt_len == 16 for r in mixed_requests(20, 16, 400, 0.0, 8, seed=1))
    with pytest.raises(ValueError):
        mixed_requests(4, 16, 400, 1.5, 8)


def test_shared_prefix_dataset_shares_prefixes():
    reqs = shared_prefix_requests(12, num_prefixes=3, prefix_len=32, suffix_len=8,
                                  output_len=4, vocab_size=1000, seed=1)
    assert len({r.prompt[:32] for r in reqs}) == 3
    assert len({r.prompt for r in reqs}) == 12
    assert all(r.prompt_len == 40 for r in reqs)
    again = shared_prefix_requests(12, 3, 32, 8, 4, 1000, seed=1)
    assert stream_hash(reqs) == stream_hash(again)


def test_sharegpt_dataset_from_a_local_file(tmp_path):
    from engine.loader.resolve import resolve_model_dir

    convs = [{"conversations": [{"from": "human", "value": f"Question number {i}, please?"},
                                {"from": "gpt", "value": "An answer of some length. " * i}]}
             for i in range(1, 8)]
    convs.append({"conversations": [{"from": "human", "value": "hi"}]})  # no reply: skipped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    tok = resolve_model_dir(None)
    reqs = sharegpt_requests(path, 4, tok, seed=3)
    assert len(reqs) == 4 and all(isinstance(r.prompt, str) for r in reqs)
    assert stream_hash(reqs) == stream_hash(sharegpt_requests(path, 4, tok, seed=3))
    assert {r.output_len for r in sharegpt_requests(path, 4, tok, output_len=9)} == {9}
    with pytest.raises(ValueError, match="usable"):
        sharegpt_requests(path, 50, tok)


def test_poisson_arrivals_are_deterministic():
    a = arrival_offsets(2000, rate=4.0, burstiness=1.0, seed=3)
    assert a == arrival_offsets(2000, 4.0, 1.0, seed=3)
    assert a != arrival_offsets(2000, 4.0, 1.0, seed=4)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert a[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate
    # Burstier: same mean gap, more spread.
    gaps = lambda xs: [y - x for x, y in zip(xs, xs[1:])]  # noqa: E731
    spread = lambda g: sum((x - 0.25) ** 2 for x in g) / len(g)  # noqa: E731
    bursty = arrival_offsets(2000, 4.0, burstiness=0.25, seed=3)
    assert spread(gaps(bursty)) > 2 * spread(gaps(a))
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]
    with pytest.raises(ValueError):
        parse_rates("0")


class _SlowClient:
    """Answers each request after 50 ms, noting when it began and how many
    requests were in flight."""

    def __init__(self) -> None:
        self.in_flight = self.peak = 0
        self.began: list[float] = []

    async def send(self, request: BenchRequest) -> RequestRecord:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        start = time.perf_counter()
        self.began.append(start)
        await asyncio.sleep(0.05)
        self.in_flight -= 1
        now = time.perf_counter()
        return RequestRecord(request.prompt_len, start, now, [now], [request.output_len])


def test_runner_follows_the_schedule_and_the_concurrency_limit():
    reqs = random_requests(6, 4, 2, seed=0)
    client = _SlowClient()
    offsets = [0.0, 0.0, 0.1, 0.1, 0.2, 0.3]
    result = asyncio.run(run_stream(client, reqs, offsets, progress=False))
    began = [t - min(client.began) for t in client.began]
    assert sorted(began)[-1] >= 0.295 and len(result.records) == 6
    assert result.duration_s >= 0.345
    limited = _SlowClient()
    asyncio.run(run_stream(limited, reqs, [0.0] * 6, max_concurrency=2, progress=False))
    assert limited.peak == 2


def test_compare_gate_and_table():
    ok = [RequestRecord(1, text="a b"), RequestRecord(1, text="c")]
    assert gate_mismatch(ok, [RequestRecord(1, text="a b"), RequestRecord(1, text="c")]) is None
    assert "expected 'c'" in gate_mismatch(ok, [ok[0], RequestRecord(1, text="d")])
    assert "failed" in gate_mismatch(ok, [ok[0], RequestRecord(1, error="HTTP 500")])
    assert parse_arms("tandem-colocated,hf") == ["hf", "tandem-colocated"]
    with pytest.raises(ValueError):
        parse_arms("tandem-colocated")
    from tandem.bench.runner import RunResult
    from tandem.bench.serve import RatePoint

    def point(tok_s_scale):
        recs = [record(0.0, [0.1, 0.2], 0.2 * tok_s_scale)]
        return RatePoint(1.0, "h", RunResult(recs, 1.0), compute_metrics(recs, 1.0 / tok_s_scale))

    table = comparison_table({"hf": [point(1)], "tandem-colocated": [point(2)]},
                             ["hf", "tandem-colocated"])
    assert "(1.00x)" in table and "(2.00x)" in table


# ---- real runs on a tiny model -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer (the
    gateway tokenizes; the HF baseline decodes)."""
    import torch
    import transformers

    from engine.loader.resolve import resolve_model_dir

    path = tmp_path_factory.mktemp("bench") / "tiny-llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
        initializer_range=0.3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    smol = resolve_model_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, path / name)
    return path


def test_bench_serve_against_a_gateway_and_worker(tiny_model, tmp_path, capsys):
    from tandem.cluster import LocalCluster, free_port
    from tandem.up import start_cluster, up_args

    args = up_args(prefill=0, decode=1, model=str(tiny_model), port=free_port(),
                   grpc_port=free_port(), kv_cache_gib=0.05, dtype="float32",
                   worker_arg=["--num-blocks", "64"])
    flags = ["--num-prompts", "4", "--random-input-len", "12", "--random-output-len", "5",
             "--random-range-ratio", "0.5", "--vocab-size", "49152", "--request-rate", "20",
             "--seed", "11", "--goodput", "ttft:60000", "tpot:60000", "--no-progress",
             "--result-dir", str(tmp_path)]
    with LocalCluster() as cluster:
        gateway = start_cluster(args, cluster)
        assert main(["bench", "serve", "--url", f"http://{gateway.address}", "--label", "http",
                     *flags]) == 0
        assert main(["bench", "serve", "--url", f"grpc://{gateway.extra['grpc']}",
                     "--label", "grpc", *flags]) == 0
    out = capsys.readouterr().out
    assert "TPOT: per request, (E2E - TTFT) / (output_tokens - 1)" in out
    expected = sum(r.output_len for r in random_requests(4, 12, 5, 0.5, 49152, seed=11))
    runs = {}
    for label in ("http", "grpc"):
        result = json.loads((tmp_path / f"{label}.json").read_text())
        (run,) = result["runs"]
        runs[label] = run
        m = run["metrics"]
        assert (m["completed"], m["failed"]) == (4, 0)
        assert m["output_tokens"] == expected  # ignore_eos + max_tokens: exact lengths
        assert m["goodput"] == pytest.approx(m["request_throughput"])  # generous SLOs
        ttfts = [r["ttft_s"] * 1000 for r in run["requests"]]
        assert m["ttft"]["mean"] == pytest.approx(sum(ttfts) / 4)
        assert (tmp_path / f"{label}-latency.png").stat().st_size > 0
        assert (tmp_path / f"{label}-throughput.png").stat().st_size > 0
    # The same seed sends the same stream, whichever endpoint.
    assert runs["http"]["stream_hash"] == runs["grpc"]["stream_hash"]
    assert f"stream hash {runs['http']['stream_hash']}" in out


@pytest.mark.slow
def test_bench_compare_colocated_against_hf(tiny_model, tmp_path, capsys):
    rc = main(["bench", "compare", "--model", str(tiny_model), "--arms", "tandem-colocated,hf",
               "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
               "--vocab-size", "49152", "--request-rates", "inf", "--gate-prompts", "2",
               "--kv-cache-gib", "0.05", "--no-progress", "--result-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "[tandem-colocated] correctness gate passed (2 greedy outputs match hf)" in out
    table = (tmp_path / "compare.md").read_text()
    assert "HF generate, 1 at a time" in table and "Tandem colocated" in table
    result = json.loads((tmp_path / "compare.json").read_text())
    for arm in ("hf", "tandem-colocated"):
        (run,) = result["runs"][arm]
        assert run["metrics"]["completed"] == 2 and run["metrics"]["output_tokens"] == 8
    assert result["runs"]["hf"][0]["stream_hash"] == result["runs"]["tandem-colocated"][0][
        "stream_hash"]
