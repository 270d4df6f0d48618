"""`tandem up` leaves no orphans: a closed terminal (SIGHUP) stops the whole
cluster, and a launcher killed outright takes its gateway and workers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gateway_fixtures import tiny_model

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


def _start_up() -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--model", str(tiny_model()),
           "--prefill", "1", "--decode", "1", "--port", str(free_port()),
           "--grpc-port", str(free_port()), "--kv-cache-gib", "0.01"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        if "Tandem is serving" in line:
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError("tandem up did not start")


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
        for pid in kids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.stdout.close()
