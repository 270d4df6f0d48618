"""One OpenMP team per process.

Torch's CPU kernels and ours run their parallel loops on OpenMP (libgomp),
which keeps a team of threads for each thread that ever started a parallel
region. The team's threads spin for a while at the end of a region, so the
next region starts at once; but when a process holds more team threads than
it has cores, libgomp makes every team sleep at once instead, and each
region then starts by waking its threads. A decode step is hundreds of
regions: on 2 cores, a second team (a model loaded on the main thread and
stepped on the engine's; block reads on an executor thread) took a 64-request
decode step from 49 to 69 ms.

So a process computes on one thread (the engine's, engine/async_engine.py),
and every other thread that touches tensors (the event loop, transfer and
executor threads) calls ``serial_thread()`` first: its torch work then runs
on it alone, and it never starts a team.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_RTLD_NOLOAD = 4  # glibc's: find it among the loaded libraries, never load another


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    try:  # the libgomp torch loaded (found by its soname); none on other OpenMP builds
        return ctypes.CDLL("libgomp.so.1", mode=_RTLD_NOLOAD)
    except OSError:
        return None


def serial_thread() -> None:
    """Run torch's parallel loops on the calling thread by itself (its own
    OpenMP team size becomes 1; other threads keep theirs)."""
    # Torch sizes a thread's team lazily, at its first parallel call, from
    # the process-wide setting: have that happen now, then override it.
    torch.get_num_threads()
    gomp = _libgomp()
    if gomp is not None:
        gomp.omp_set_num_threads(1)
