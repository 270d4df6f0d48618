"""One trace per request across the gateway, prefill, transfer and decode
processes; Prometheus metrics on every process, counted after real requests;
structured JSON logs carrying the request id.

Every process of the cluster writes its finished spans to one JSON-lines
file (TANDEM_TRACE_FILE); the test itself is the client, with an in-memory
exporter, and sends its span's context as ``traceparent``.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from gateway_fixtures import SERVED, start_gateway, wait_until
from opentelemetry import propagate
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from worker_fixtures import metric, scrape, start_worker

from rpc.tracing import read_trace_file
from tandem.cluster import LocalCluster

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    from gateway_fixtures import tiny_model

    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    cluster = LocalCluster(env={"TANDEM_TRACE_FILE": str(trace_file)})
    try:
        prefill = start_worker(cluster, "prefill", tiny_model(), 64, "--log-format", "json",
                               metrics=True)
        decode = start_worker(cluster, "decode", tiny_model(), 64, "--log-format", "json",
                              metrics=True)
        gateway = start_gateway(cluster, [prefill, decode], "--log-format", "json")
        yield trace_file, gateway, prefill, decode
    finally:
        cluster.stop()


def test_one_trace_spans_every_process(traced):
    trace_file, gateway, prefill, decode = traced
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client_tracer = provider.get_tracer("test-client")

    with client_tracer.start_as_current_span("client.request") as root:
        headers: dict[str, str] = {}
        propagate.inject(headers)
        reply = httpx.post(f"{gateway.url}/v1/completions", headers=headers, timeout=60, json={
            "model": SERVED, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
        })
    assert reply.status_code == 200, reply.text
    trace_id = format(root.get_span_context().trace_id, "032x")
    root_id = format(root.get_span_context().span_id, "016x")
    assert [s.name for s in exporter.get_finished_spans()] == ["client.request"]

    def ours() -> list[dict]:
        return [s for s in read_trace_file(trace_file) if s["trace_id"] == trace_id]

    wanted = {"POST /v1/completions", "gateway.tokenize", "gateway.route_and_stream",
              "gateway.reserve", "gateway.prefill", "gateway.decode", "prefill.compute",
              "kv_transfer.send", "kv_transfer.receive", "decode.generate"}
    wait_until(lambda: wanted <= {s["name"] for s in ours()}, 20,
               f"spans {wanted} in the trace file")
    spans = ours()
    by_id = {s["span_id"]: s for s in spans}
    by_name = {s["name"]: s for s in spans}

    def parent(name: str) -> dict | None:
        return by_id.get(by_name[name]["parent_id"])

    def ancestors(name: str) -> list[str]:
        out, span = [], by_name[name]
        while span["parent_id"] in by_id:
            span = by_id[span["parent_id"]]
            out.append(span["name"])
        return out

    # The gateway's root span is a child of the client's span.
    assert by_name["POST /v1/completions"]["parent_id"] == root_id
    assert parent("gateway.tokenize")["name"] == "POST /v1/completions"
    assert parent("gateway.route_and_stream")["name"] == "POST /v1/completions"
    for name in ("gateway.reserve", "gateway.prefill", "gateway.decode"):
        assert parent(name)["name"] == "gateway.route_and_stream"
    # Each worker's spans hang under the gateway's call to it, across processes.
    assert "gateway.prefill" in ancestors("prefill.compute")
    assert "gateway.prefill" in ancestors("kv_transfer.send")
    assert "kv_transfer.send" in ancestors("kv_transfer.receive")
    # The decode rode the gateway's shared DecodeMany stream: its context came
    # in the request's start message, and the long-lived call has no span.
    assert parent("decode.generate")["name"] == "gateway.decode"
    assert not [s for s in spans if s["name"].endswith("/DecodeMany")]
    services = {s["name"]: s["service"] for s in spans}
    assert services["prefill.compute"] == "tandem-prefill"
    assert services["kv_transfer.receive"] == services["decode.generate"] == "tandem-decode"
    assert services["gateway.decode"] == "tandem-gateway"
    # Attributes say what happened.
    send = by_name["kv_transfer.send"]["attributes"]
    assert send["transport"] == "grpc" and send["bytes"] > 0
    assert by_name["decode.generate"]["attributes"]["steps"] >= 1
    compute = by_name["prefill.compute"]["attributes"]
    assert compute["prompt_tokens"] > 0 and compute["cached_tokens"] == 0
    assert compute["queue_s"] >= 0
    # The gateway's log line for the request carries both ids.
    # (Read from the gateway's pipe by another thread of this process: wait
    # for it rather than race it.)
    def logged() -> list[dict]:
        lines = [json.loads(line) for line in gateway.output().splitlines()
                 if line.startswith("{")]
        return [e for e in lines if e.get("trace_id") == trace_id]

    finished = wait_until(logged, 10, "the gateway's log line for the request")
    assert finished[-1]["request_id"].startswith("cmpl-")
    assert finished[-1]["timings"]["e2e_s"] > 0


def test_metrics_count_real_requests(traced):
    _, gateway, prefill, decode = traced
    before = {w.address: scrape(w.metrics_port) for w in (prefill, decode)}
    gw_before = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    n = 3
    for i in range(n):
        r = httpx.post(f"{gateway.url}/v1/completions", timeout=60, json={
            "model": SERVED, "prompt": f"{PROMPT} {i}", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True,
        })
        assert r.status_code == 200, r.text
    time.sleep(0.3)
    gw = httpx.get(f"{gateway.url}/metrics", timeout=10).text

    def delta(text_after: str, text_before: str, name: str, **labels: str) -> float:
        return (metric(text_after, name, **labels) or 0) - (metric(text_before, name, **labels)
                                                             or 0)

    assert delta(gw, gw_before, "vllm:request_success_total", finished_reason="length") == n
    assert delta(gw, gw_before, "vllm:time_to_first_token_seconds_count") == n
    assert delta(gw, gw_before, "vllm:e2e_request_latency_seconds_count") == n
    assert delta(gw, gw_before, "vllm:request_generation_tokens_sum") == 5 * n
    assert metric(gw, "vllm:num_requests_running") == 0

    pre, dec = scrape(prefill.metrics_port), scrape(decode.metrics_port)
    kv_bytes = delta(pre, before[prefill.address], "tandem:kv_transfer_bytes_total",
                     transport="grpc", direction="send")
    assert kv_bytes > 0
    assert delta(dec, before[decode.address], "tandem:kv_transfer_bytes_total",
                 transport="grpc", direction="recv") == kv_bytes
    assert delta(pre, before[prefill.address], "tandem:kv_transfer_seconds_count",
                 transport="grpc", direction="send") == n
    assert delta(dec, before[decode.address], "vllm:request_success_total",
                 finished_reason="length") == n
    assert delta(dec, before[decode.address], "vllm:request_generation_tokens_sum") == 5 * n
    assert delta(pre, before[prefill.address], "vllm:prefix_cache_queries_total") > 0
    assert metric(dec, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(dec, "tandem:kv_reservations_held") == 0
    # The gateway decodes over one stream it keeps open, not a call per request.
    assert metric(dec, "tandem:decode_streams") == 1
    messages = delta(dec, before[decode.address], "tandem:decode_stream_messages_total")
    chunks = delta(dec, before[decode.address], "tandem:decode_stream_chunks_total")
    assert messages > 0 and chunks >= n
    for text in (pre, dec):
        assert metric(text, "vllm:num_requests_running") == 0
        assert metric(text, "vllm:num_requests_waiting") == 0


def test_worker_logs_are_json(traced):
    _, _, prefill, _ = traced
    lines = [line for line in prefill.proc.output().splitlines() if line.startswith("{")]
    assert lines, "the prefill worker wrote no JSON log lines"
    entry = json.loads(lines[0])
    assert {"ts", "level", "logger", "msg"} <= set(entry)


def test_a_span_still_being_written_is_left_for_the_next_read(tmp_path):
    # Workers append to the trace file while tests read it: a torn last line
    # must not fail the read (it did once in make test), nor be returned.
    path = tmp_path / "spans.jsonl"
    assert read_trace_file(path) == []
    path.write_text('{"name": "a"}\n{"name": "b"}\n{"name": "c", "attrib')
    assert [s["name"] for s in read_trace_file(path)] == ["a", "b"]
    with open(path, "a") as f:
        f.write('utes": {}}\n')
    assert [s["name"] for s in read_trace_file(path)] == ["a", "b", "c"]
