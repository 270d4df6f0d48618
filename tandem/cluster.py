"""A local cluster: worker and gateway processes on this machine.

Used by ``tandem up`` (and so ``make run``), the benchmarks and the tests.
Each process prints ``TANDEM_READY <role> <id> <address>`` once it serves;
the launcher waits for that line, and stops everything with SIGTERM (then
SIGKILL after a grace period).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rpc.parent_death import ENV as PARENT_ENV

ROOT = Path(__file__).resolve().parent.parent

MODULES = {"prefill": "prefill_service", "decode": "decode_service", "both": "decode_service",
           "gateway": "gateway"}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (for a process started next to bind)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    role: str
    popen: subprocess.Popen
    address: str = ""
    worker_id: str = ""
    extra: dict[str, str] = field(default_factory=dict)  # e.g. the gateway's grpc=host:port
    lines: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self, grace: float = 10.0) -> int | None:
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def kill(self) -> None:
        if self.alive:
            self.popen.kill()
            self.popen.wait()

    def output(self) -> str:
        return "\n".join(self.lines)


class LocalCluster:
    def __init__(self, log_dir: Path | None = None, env: dict[str, str] | None = None,
                 echo: bool = False) -> None:
        self.procs: list[Proc] = []
        self.log_dir = log_dir
        # Children end with this process, however it ends (rpc/parent_death.py).
        self.env = {**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())}
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in [str(ROOT), self.env.get("PYTHONPATH", "")] if p
        )
        self.echo = echo

    def start(self, role: str, args: list[str], timeout: float = 180.0) -> Proc:
        """Start one process (``role``: prefill, decode, both or gateway) and
        wait until it serves."""
        return self.start_all([(role, args)], timeout)[0]

    def start_all(self, specs: list[tuple[str, list[str]]], timeout: float = 180.0,
                  ) -> list[Proc]:
        """Start one process per ``(role, args)`` at once and wait until all
        of them serve: their start-ups (interpreter, imports, model load,
        warm-up) overlap instead of queueing. If any fails, the others of
        this call are stopped too."""
        started = [self._spawn(role, args) for role, args in specs]
        deadline = time.monotonic() + timeout
        try:
            for proc, ready in started:
                while not ready.wait(0.1):
                    if not proc.alive or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{proc.role} process failed to start:\n{proc.output()[-4000:]}")
        except BaseException:
            for proc, _ in started:
                proc.kill()
            raise
        return [proc for proc, _ in started]

    def _spawn(self, role: str, args: list[str]) -> tuple[Proc, threading.Event]:
        cmd = [sys.executable, "-m", MODULES[role], *args]
        if role in ("decode", "both"):
            cmd += ["--role", role]
        popen = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env,
            cwd=str(ROOT), start_new_session=True,
        )
        proc = Proc(role, popen)
        self.procs.append(proc)
        ready = threading.Event()
        threading.Thread(target=self._pump, args=(proc, ready), daemon=True).start()
        return proc, ready

    def _pump(self, proc: Proc, ready: threading.Event) -> None:
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{proc.role}-{proc.popen.pid}.log", "w")  # noqa: SIM115
        assert proc.popen.stdout is not None
        for line in proc.popen.stdout:
            line = line.rstrip("\n")
            proc.lines.append(line)
            if len(proc.lines) > 5000:
                del proc.lines[:1000]
            if log is not None:
                log.write(line + "\n")
                log.flush()
            if self.echo:
                print(f"[{proc.role}] {line}", flush=True)
            if line.startswith("TANDEM_READY "):
                parts = line.split()
                proc.worker_id, proc.address = parts[2], parts[3]
                proc.extra = dict(p.split("=", 1) for p in parts[4:] if "=" in p)
                ready.set()
        if log is not None:
            log.close()

    def stop(self, grace: float = 10.0) -> None:
        # Gateways first, so no new work reaches the workers while they drain;
        # then every worker at once: each drains on its own, in parallel.
        workers = [p for p in self.procs if p.role != "gateway"]
        for proc in self.procs:
            if proc.role == "gateway":
                proc.terminate(grace)
        for proc in workers:
            if proc.alive:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in workers:
            proc.terminate(grace)  # waits; kills what outlives the grace period
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
