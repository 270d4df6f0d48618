"""The peers comparison's plumbing: the machine and its load, the checkout,
and subprocesses run one at a time (logged, time-limited, stopped as a
group, so nothing outlives a run)."""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def machine() -> dict:
    model = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return f"load average {os.getloadavg()}"


def git_state() -> str:
    """The checkout Tandem ran from: commit, and how many tracked files differed from it
    (the checkout is shared with other work in progress)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    except OSError:
        return "unknown"
    return head + (f" + {len(dirty)} modified files" if dirty else "")


class LoadSampler:
    """The 1-minute load average every few seconds while a run goes on."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s, self.samples = every_s, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self.before = uptime()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])
        self.after = uptime()

    def summary(self) -> dict:
        return {"before": self.before, "after": self.after,
                "mean_1min": sum(self.samples) / len(self.samples),
                "max_1min": max(self.samples)}


# --------------------------------------------------------------------------- subprocesses


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process we started (it shuts its own children down), then its process
    group, then SIGKILL the group. Only processes this script started are signalled."""
    for sig, target in ((signal.SIGTERM, "proc"), (signal.SIGTERM, "group"),
                        (signal.SIGKILL, "group")):
        if proc.poll() is not None and target == "proc":
            continue
        try:
            if target == "proc":
                proc.send_signal(sig)
            else:
                os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            if target == "proc":
                # NOTE: give its children a moment to leave, then make sure of it.
                time.sleep(1.0)
        except subprocess.TimeoutExpired:
            pass


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float) -> int:
    """Run to completion in its own session, output to ``log``; -1 on timeout."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return -1
        finally:
            if proc.poll() is None:
                stop_group(proc)
            else:
                # The run exited; anything it left behind in its group goes too.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            # NOTE: without it vLLM's serving processes drop to one torch thread.
            "OMP_NUM_THREADS": str(os.cpu_count() or 1),
            "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


# --------------------------------------------------------------------------- offline
