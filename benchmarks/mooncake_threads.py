"""Where a Mooncake TCP write spends its CPU, beside raw TCP, with no worker.

    .venv/bin/python benchmarks/mooncake_threads.py [--rounds 3] [--reps 60] [--nap-us 100]
        [--sender-cpus 0] [--peer-cpus 1]

Two processes on loopback. Each round times ``--reps`` transfers of 64 MiB
by raw TCP (one ``sendall`` into a peer's ``recv_into``), then the same with
the Mooncake transfer engine (8 segments of 8 MiB written into the peer's
registered buffer, status polled with naps of ``--nap-us``, as
kv_transfer/mooncake_endpoint.py does), and prints each arm's MiB/s with
the CPU time of every thread that used more than 1% of the wall time.
``--sender-cpus`` / ``--peer-cpus`` pin the two processes (cpuset syntax);
Mooncake's own settings come from the environment (``MC_TCP_SLICE_SIZE``,
``MC_TCP_LANES_PER_PEER``, 2 unless set, as the workers set it).
transfer.py measures the workers' path; this one isolates the engine, so
that what is left between it and raw TCP is the library's.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import socket
import time

from worker.cpu_cores import parse_cores

SIZE = 64 << 20
SEGMENTS = 8
WARMUP = 3


def thread_cpu(pid: int) -> dict[tuple[str, str], float]:
    """(thread id, name) -> user + system CPU seconds, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[(tid, name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def busy_threads(label: str, before: dict, after: dict, wall: float) -> list[str]:
    lines = []
    for key, cpu in sorted(after.items()):
        used = cpu - before.get(key, 0.0)
        if used > 0.01 * wall:
            lines.append(f"    {label} thread {key[1]:<15} {used:5.2f} s CPU, {used / wall:4.0%}"
                         " of the wall time")
    return lines


def timed(one, reps: int, peer_pid: int) -> tuple[float, list[str]]:
    """MiB/s of ``reps`` calls of ``one`` (after a warm-up), and the busy
    threads of this process and the peer over them."""
    for _ in range(WARMUP):
        one()
    before, before_peer = thread_cpu(os.getpid()), thread_cpu(peer_pid)
    start = time.perf_counter()
    for _ in range(reps):
        one()
    wall = time.perf_counter() - start
    lines = busy_threads("sender", before, thread_cpu(os.getpid()), wall)
    lines += busy_threads("peer  ", before_peer, thread_cpu(peer_pid), wall)
    return reps * 64 / wall, lines


# ---- raw TCP ----------------------------------------------------------------------------------

def _pin(cpus: str | None) -> None:
    if cpus:
        os.sched_setaffinity(0, parse_cores(cpus))


def _tcp_peer(port: int, count: int, cpus: str | None) -> None:
    _pin(cpus)
    sock = socket.create_connection(("127.0.0.1", port))
    view = memoryview(bytearray(SIZE))
    for _ in range(count):
        got = 0
        while got < SIZE:
            got += sock.recv_into(view[got:], SIZE - got)
        sock.sendall(b"k")


def raw_tcp(reps: int, peer_cpus: str | None) -> tuple[float, list[str]]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    peer = mp.Process(target=_tcp_peer,
                      args=(listener.getsockname()[1], reps + WARMUP, peer_cpus))
    peer.start()
    conn, _ = listener.accept()
    payload = bytearray(os.urandom(1 << 20) * (SIZE >> 20))

    def one() -> None:
        conn.sendall(payload)
        conn.recv(1)

    rate, lines = timed(one, reps, peer.pid)
    peer.join()
    conn.close()
    listener.close()
    return rate, lines


# ---- Mooncake ---------------------------------------------------------------------------------

def _engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("the mooncake transfer engine did not start")
    return engine


def _mooncake_peer(queue, done, cpus: str | None) -> None:
    _pin(cpus)
    buf = ctypes.create_string_buffer(SIZE)
    ctypes.memset(buf, 1, SIZE)  # touched: no page faults in the timed writes
    engine = _engine()
    if engine.register_memory(ctypes.addressof(buf), SIZE) != 0:
        raise SystemExit("could not register the peer's buffer")
    queue.put((f"127.0.0.1:{engine.get_rpc_port()}", ctypes.addressof(buf)))
    done.wait()


def mooncake(reps: int, nap_s: float, peer_cpus: str | None) -> tuple[float, list[str]]:
    queue, done = mp.Queue(), mp.Event()
    peer = mp.Process(target=_mooncake_peer, args=(queue, done, peer_cpus))
    peer.start()
    address, remote = queue.get()
    buf = ctypes.create_string_buffer(SIZE)
    ctypes.memset(buf, 2, SIZE)
    engine = _engine()
    local = ctypes.addressof(buf)
    if engine.register_memory(local, SIZE) != 0:
        raise SystemExit("could not register the sender's buffer")
    step = SIZE // SEGMENTS

    def one() -> None:
        ids = [engine.transfer_submit_write(address, local + i * step, remote + i * step, step)
               for i in range(SEGMENTS)]
        while ids:
            ids = [b for b in ids if engine.transfer_check_status(b) == 0]
            if ids:
                time.sleep(nap_s)

    rate, lines = timed(one, reps, peer.pid)
    done.set()
    peer.join()
    engine.unregister_memory(local)
    return rate, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=60, help="64 MiB transfers per arm and round")
    ap.add_argument("--nap-us", type=float, default=100.0, help="between status polls")
    ap.add_argument("--sender-cpus", default=None, help="pin the sender, e.g. 0")
    ap.add_argument("--peer-cpus", default=None, help="pin the peer, e.g. 1")
    args = ap.parse_args()
    os.environ.setdefault("MC_TCP_LANES_PER_PEER", "2")  # as the workers set it
    mp.set_start_method("spawn")
    _pin(args.sender_cpus)
    for r in range(args.rounds):
        tcp, tcp_lines = raw_tcp(args.reps, args.peer_cpus)
        mc, mc_lines = mooncake(args.reps, args.nap_us * 1e-6, args.peer_cpus)
        print(f"round {r + 1}: raw tcp {tcp:.0f} MiB/s, mooncake {mc:.0f} MiB/s "
              f"({mc / tcp:.0%})", flush=True)
        for line in tcp_lines + mc_lines:
            print(line)


if __name__ == "__main__":
    main()
