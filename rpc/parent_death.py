"""A process started by a launcher (``tandem up``, a test's cluster) ends
when its launcher does, however the launcher dies (a SIGKILL included), so
that no gateway or worker outlives it holding its port.

The launcher names itself in ``TANDEM_PARENT_PID``; the child, first thing,
asks the kernel for a SIGTERM when that parent dies (PR_SET_PDEATHSIG; it
then drains as on any SIGTERM). Done by the child, not in a ``preexec_fn``:
code run between fork and exec in a threaded launcher can deadlock.
Linux only; elsewhere a no-op.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "TANDEM_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    parent = os.environ.pop(ENV, None)  # not inherited by this process's own children
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(parent):  # the launcher died before the prctl took hold
        os.kill(os.getpid(), signal.SIGTERM)
