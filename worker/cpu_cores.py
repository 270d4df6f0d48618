"""Which CPU cores a worker computes on.

Two workers on one host that each run a full OpenMP team oversubscribe the
cores, and a team whose threads are descheduled waits at every barrier: a
matmul was seen 60x slower that way. So workers on one host each get their
own cores: ``--cpu-cores 0-3`` pins the process and sizes torch's team to
match, and ``split_cores`` deals a host's cores out to its workers. With
``--borrow-cores`` a worker also computes on its neighbours' cores while
they idle, one step at a time (engine/core_lease.py).

Core lists use the kernel's cpuset syntax: ``0-3,8,10-11``.
"""

from __future__ import annotations

import os


def parse_cores(spec: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``. ValueError for anything else."""
    cores: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad core list {spec!r}: expected e.g. 0-3,6") from None
        if first < 0 or last < first:
            raise ValueError(f"bad core range {part!r} in {spec!r}")
        cores.update(range(first, last + 1))
    return sorted(cores)


def format_cores(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts, i = [], 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        parts.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(parts)


def split_cores(num_workers: int, available: list[int] | None = None) -> list[str] | None:
    """Disjoint core lists for ``num_workers`` workers on this host, as even as
    the cores allow (earlier workers get the spare ones), or None when there
    are fewer cores than workers: then they share, each with a smaller team."""
    cores = sorted(available if available is not None else os.sched_getaffinity(0))
    if num_workers < 1 or len(cores) < num_workers:
        return None
    share, spare = divmod(len(cores), num_workers)
    out, start = [], 0
    for i in range(num_workers):
        n = share + (i < spare)
        out.append(format_cores(cores[start : start + n]))
        start += n
    return out


def placement_flags(shares: list[str], lend: bool = True) -> list[list[str]]:
    """Each worker's flags for its share of the cores (``split_cores``):
    ``--cpu-cores``, and with ``lend`` (and two shares or more)
    ``--borrow-cores`` over all of them, so that each computes on the
    others' cores while they idle. How ``tandem up`` places its workers."""
    borrow = ["--borrow-cores", ",".join(shares)] if lend and len(shares) > 1 else []
    return [["--cpu-cores", share, *borrow] for share in shares]


def check_available(cores: list[int], what: str = "cores") -> list[int]:
    """``cores``, if this process may run on every one of them; ValueError
    naming the ones it may not (``what``: the flag they came from)."""
    allowed = os.sched_getaffinity(0)
    missing = [c for c in cores if c not in allowed]
    if missing:
        raise ValueError(f"{what} {format_cores(missing)} are not available to this process "
                         f"(it may use {format_cores(sorted(allowed))})")
    return cores


def pin_to_cores(spec: str, borrow: str | None = None) -> list[int]:
    """Run this process on the cores in ``spec`` only, with one torch thread
    per core; with ``borrow``, on those too (the process may run there, and
    a core lease decides when it does). Call before the engine is built
    (torch sizes its team lazily, but an engine may start worker ranks that
    inherit the affinity)."""
    import torch

    cores = parse_cores(spec)
    reach = check_available(sorted(set(cores) | set(parse_cores(borrow) if borrow else [])))
    os.sched_setaffinity(0, reach)
    torch.set_num_threads(len(cores))
    return cores


def default_lock_dir() -> str:
    """Where the workers of this host and user meet to lend cores."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"tandem-cores-{os.getuid()}")
