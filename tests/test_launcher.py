"""`tandem up` leaves no orphans: a closed terminal (SIGHUP) stops the whole
cluster, and a launcher killed outright takes its gateway and workers with it.
With ``--metrics-port`` it prints each worker's /metrics address, which
``tandem bench serve --metrics-url`` reads speculation's acceptance from."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from gateway_fixtures import tiny_model

from tandem.bench import spec_metrics
from tandem.cluster import ROOT, free_port


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{pid}\n" in status:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited; nobody reaped it yet


def _start_up(*extra: str, ready: str = "Tandem is serving",
              lines: list[str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--model", str(tiny_model()),
           "--prefill", "1", "--decode", "1", "--port", str(free_port()),
           "--grpc-port", str(free_port()), "--kv-cache-gib", "0.01", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        if lines is not None:
            lines.append(line)
        if ready in line:
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError("tandem up did not start")


def _counter(url: str, name: str) -> float:
    text = httpx.get(url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def _two_free_ports() -> int:
    for _ in range(50):
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise AssertionError("no two free ports in a row")


def _kill_all(proc: subprocess.Popen, kids: list[int]) -> None:
    """Whatever a test left running: the launcher and its children."""
    for pid in kids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.stdout.close()


def _wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("how", ["SIGHUP", "SIGKILL"])
def test_the_cluster_dies_with_its_launcher(how):
    proc = _start_up()
    kids = _children(proc.pid)
    try:
        assert len(kids) == 3, kids  # a prefill worker, a decode worker, the gateway
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=60)
        if how == "SIGHUP":
            assert proc.returncode == 0  # stopped as with Ctrl-C, not killed by the signal
        assert _wait_gone(kids) == [], "processes outlived their launcher"
    finally:
        _kill_all(proc, kids)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_a_dead_worker_is_reported_and_the_rest_serve_on():
    lines: list[str] = []
    proc = _start_up("--decode", "2", lines=lines)
    kids = _children(proc.pid)
    try:
        url = "".join(lines).split("Tandem is serving at ")[1].split()[0]
        decodes = [pid for pid in kids if "decode_service" in _cmdline(pid)]
        assert len(decodes) == 2, [_cmdline(pid) for pid in kids]
        os.kill(decodes[0], signal.SIGKILL)
        time.sleep(2)  # the launcher looks twice a second
        assert proc.poll() is None, "one worker's death stopped the cluster"
        for _ in range(3):  # whichever decode worker a request is sent to, it is served
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "prompt": "a b c", "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
        os.kill(decodes[1], signal.SIGKILL)  # no decode worker left: nothing is served
        assert proc.wait(timeout=30) == 1
        assert _wait_gone(kids) == [], "processes outlived their launcher"
    finally:
        _kill_all(proc, kids)


def test_metrics_port_gives_the_decode_workers_speculation_counters():
    """(And --max-model-len reaches every process.)"""
    base = _two_free_ports()  # the prefill worker's /metrics at base, the decode worker's next
    lines: list[str] = []
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}'
    proc = _start_up("--metrics-port", str(base), f"--worker-arg=--speculative-config={spec}",
                     "--max-model-len", "200", ready="Ctrl-C stops it", lines=lines)
    try:
        text = "".join(lines)
        url = text.split("Tandem is serving at ")[1].split()[0]
        decode_url = f"http://127.0.0.1:{base + 1}/metrics"
        assert f"prefill worker 0 metrics: http://127.0.0.1:{base}/metrics" in text
        assert f"decode worker 0 metrics: {decode_url}" in text
        before = spec_metrics.scrape(decode_url)
        assert before is not None, "the decode worker exports no speculation counters"
        # --max-model-len reaches the gateway as well as the workers.
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["max_model_len"] == 200
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": "a b c a b c a b c a b c", "max_tokens": 16, "ignore_eos": True})
        assert r.status_code == 200, r.text
        served = httpx.get(decode_url, timeout=10).text
        finished = sum(float(line.rsplit(" ", 1)[1]) for line in served.splitlines()
                       if line.startswith("vllm:request_success_total"))
        assert finished == 1  # this address is the worker that decoded the request
        assert spec_metrics.scrape(decode_url) is not None
        # The prefill worker does not speculate: its counters stay at zero.
        assert spec_metrics.scrape(f"http://127.0.0.1:{base}/metrics").drafts == 0
        if len(os.sched_getaffinity(0)) >= 2:
            # Each worker owns a core and lends it while it idles: the prefill
            # ran while the decode worker had nothing to do, and the other way round.
            borrowed = [_counter(f"http://127.0.0.1:{port}/metrics",
                                 "tandem:cpu_borrowed_steps_total")
                        for port in (base, base + 1)]
            assert borrowed[0] >= 1 and borrowed[1] >= 1, borrowed
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        proc.stdout.close()
