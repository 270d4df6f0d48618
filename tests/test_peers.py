"""The side-by-side harness's pure helpers (benchmarks/peers/harness.py): seeded workloads,
token agreement, tables, and the command line's sizes. Nothing here needs vLLM, and no
speed is checked."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parent.parent / "benchmarks" / "peers"


def _load(name: str):
    if str(PEERS) not in sys.path:  # the scripts import each other by name
        sys.path.insert(0, str(PEERS))
    spec = importlib.util.spec_from_file_location(f"peers_{name}", PEERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


harness = _load("harness")


def test_workload_is_seeded_and_deterministic():
    a = harness.make_workload("mixed", 16, (32, 512), (16, 256), 49152, seed=0)
    b = harness.make_workload("mixed", 16, (32, 512), (16, 256), 49152, seed=0)
    c = harness.make_workload("mixed", 16, (32, 512), (16, 256), 49152, seed=1)
    assert a == b and a.sha256 == b.sha256
    assert a.sha256 != c.sha256
    assert all(32 <= len(p) <= 512 for p in a.prompts)
    assert all(16 <= n <= 256 for n in a.output_lens)
    assert all(harness.FIRST_PLAIN_TOKEN <= t < 49152 for p in a.prompts for t in p)
    # A fixed seed means the same prompts on every machine, not just within one process.
    assert a.prompts[0][:3] == harness.make_workload(
        "mixed", 1, (32, 512), (16, 256), 49152, seed=0).prompts[0][:3]


def test_uniform_workload_has_exact_lengths():
    w = harness.make_workload("uniform", 64, (128, 128), (128, 128), 49152, seed=0)
    assert [len(p) for p in w.prompts] == [128] * 64
    assert w.output_lens == [128] * 64
    assert w.num_output_tokens == 64 * 128 and w.num_prompt_tokens == 64 * 128
    assert w.name in w.describe() and w.sha256[:16] in w.describe()


@pytest.mark.parametrize("kwargs", [
    {"num_prompts": 0}, {"vocab_size": 50}, {"prompt_lens": (10, 5)}, {"output_lens": (0, 4)}])
def test_workload_rejects_bad_sizes(kwargs):
    args = {"name": "x", "num_prompts": 2, "prompt_lens": (4, 8), "output_lens": (4, 8),
            "vocab_size": 1000, "seed": 0} | kwargs
    with pytest.raises(ValueError):
        harness.make_workload(**args)


def test_token_agreement_counts_and_locates_partings():
    same, parted = harness.token_agreement([[1, 2, 3], [4, 5, 6], [7, 8]],
                                           [[1, 2, 3], [4, 9, 6], [7, 8, 1]])
    assert same == 1
    assert parted == [(1, 1), (2, 2)]
    with pytest.raises(ValueError):
        harness.token_agreement([[1]], [])


def test_tables_render():
    table = harness.offline_table([
        {"workload": "uniform", "dtype": "float32", "vllm": [200.0, 250.0],
         "tandem": [100.0], "same": 64, "total": 64, "load": "1.0 / 1.2"},
        {"workload": "mixed", "dtype": "bfloat16", "vllm": [], "tandem": [90.0],
         "same": None, "total": None},
    ])
    lines = table.splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    assert "| 250 (200) " in lines[2] and "| 0.40x " in lines[2] and "64/64" in lines[2]
    assert "| -  " in lines[3]  # vLLM did not run: no number, no ratio
    serving = harness.serving_table([
        {"server": "vLLM", "rate": "inf", "ok": 64, "failed": 0, "output_tok_s": 343.2,
         "ttft_p50_ms": 3300.0, "ttft_mean_ms": 2950.0, "tpot_p50_ms": 135.4, "load": "2.0"}])
    assert "| 343 " in serving and "3.30 s" in serving and "135 ms" in serving
    assert "| 2.95 s " in serving and "TTFT mean" in serving
    with pytest.raises(ValueError):
        harness.markdown_table(["a", "b"], [["1"]])


def test_rate_and_ratio_cells():
    assert harness.rate_cell([]) == "-"
    assert harness.rate_cell([150.4, 246.0]) == "246 (150)"
    assert harness.ratio_cell([100.0], [200.0]) == "0.50x"
    assert harness.ratio_cell([100.0], []) == "-"


def test_quick_flag_shrinks_every_size():
    compare = _load("compare")
    args = compare.parse_args(["--quick"])
    assert args.num_prompts == 8 and args.dtypes == "float32"
    assert args.serve_num_prompts == 8 and args.uniform_output_len < 128
    args = compare.parse_args(["--quick", "--dtypes", "bfloat16"])
    assert args.dtypes == "bfloat16"
    full = compare.parse_args([])
    assert (full.num_prompts, full.uniform_prompt_len, full.uniform_output_len) == (64, 128, 128)
    assert compare.lengths("32-512") == (32, 512) and compare.lengths("7") == (7, 7)


def test_each_serving_point_has_prompts_of_its_own():
    compare = _load("compare")
    serving = _load("serving")
    args = compare.parse_args(["--serve-rates", "inf,6", "--serve-repeat", "2",
                               "--serve-num-prompts", "4"])
    args.vocab_size = 1000
    plan = serving.serving_plan(args)
    assert [rate for rate, _ in plan] == [float("inf"), 6.0, float("inf"), 6.0]
    prompts = [tuple(tuple(r.prompt) for r in requests) for _, requests in plan]
    assert len(set(prompts)) == 4  # no point finds another's prompts in a prefix cache
    again = serving.serving_plan(args)  # every server gets the same plan
    assert [tuple(tuple(r.prompt) for r in requests) for _, requests in again] == prompts


def test_repeated_serving_points_summarize_to_medians():
    serving = _load("serving")
    points = [{"rate": "inf", "ok": 64, "failed": 0, "output_tok_s": tok, "ttft_p50_ms": ttft,
               "ttft_mean_ms": ttft + 50, "tpot_p50_ms": 70.0}
              for tok, ttft in ((700.0, 900.0), (760.0, 800.0), (730.0, 1000.0))]
    points.append({"rate": "6.0", "ok": 63, "failed": 1, "output_tok_s": 300.0,
                   "ttft_p50_ms": 90.0, "tpot_p50_ms": 30.0})
    points.append({"rate": "6.0", "ok": 0, "failed": 64, "output_tok_s": 0.0,
                   "ttft_p50_ms": float("nan"), "tpot_p50_ms": float("nan")})
    rows = serving.summarize("vllm", points, "1.0")
    assert [r["rate"] for r in rows] == ["inf", "6.0"]
    assert (rows[0]["output_tok_s"], rows[0]["ttft_p50_ms"], rows[0]["ok"]) == (730.0, 900.0, 192)
    assert rows[1]["failed"] == 65 and rows[1]["repeats"] == 2
    assert rows[0]["ttft_mean_ms"] == 950.0
    assert rows[1]["ttft_p50_ms"] == 90.0  # the run that completed nothing has no TTFT
    table = harness.serving_table(rows)
    assert "700 / 760 / 730" in table and "| 730 " in table


def test_a_burst_keeps_every_completed_requests_ttft():
    from tandem.bench.metrics import RequestRecord, compute_metrics
    from tandem.bench.runner import RunResult
    from tandem.bench.serve import RatePoint

    serving = _load("serving")
    records = [RequestRecord(prompt_len=4, start=0.0, end=1.0, chunk_times=[0.15, 0.5],
                             chunk_tokens=[1, 1]),
               RequestRecord(prompt_len=4, start=0.01, end=1.2, chunk_times=[0.46, 0.9],
                             chunk_tokens=[1, 1]),
               RequestRecord(prompt_len=4, start=0.02, end=0.03, error="HTTP 429")]
    result = RunResult(records, 1.2)
    point = serving.point_record(RatePoint(float("inf"), "abc", result,
                                           compute_metrics(records, 1.2)))
    assert point["ttft_each_ms"] == [150.0, 450.0]  # arrival order; the failed one has none
    assert (point["ok"], point["failed"], point["errors"]) == (2, 1, ["HTTP 429"])
    assert point["ttft_mean_ms"] == pytest.approx(300.0)
    assert point["rate"] == "inf" and point["stream_hash"] == "abc"


def test_a_tandem_server_may_carry_worker_flags():
    compare = _load("compare")
    serving = _load("serving")
    spec = "tandem-colocated:--max-num-batched-tokens=512;--max-num-seqs=64"
    assert serving.split_server(spec) == (
        "tandem-colocated", ["--max-num-batched-tokens=512", "--max-num-seqs=64"])
    assert serving.server_label(spec).endswith(
        "[--max-num-batched-tokens=512 --max-num-seqs=64]")
    args = compare.parse_args(["--servers", f"vllm,{spec}", "--serve-dtype", "float32"])
    args.vllm_python = "python"
    cmd, _ = serving.server_command(spec, args, Path("/models/m"), 8000)
    assert cmd[-2:] == ["--worker-arg=--max-num-batched-tokens=512",
                        "--worker-arg=--max-num-seqs=64"]
    plain, _ = serving.server_command("tandem-colocated", args, Path("/models/m"), 8000)
    grpc_port = plain.index("--grpc-port") + 1  # a free port, picked anew each time
    del plain[grpc_port], cmd[grpc_port]
    assert plain == cmd[:-2]
    for bad in ("vllm:--enforce-eager", "tandem-colocatd"):
        with pytest.raises(SystemExit):
            compare.parse_args(["--servers", bad])
