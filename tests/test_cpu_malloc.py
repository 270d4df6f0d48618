"""engine/cpu_malloc.py: after keep_freed_memory(), a large block freed and
allocated again is reused from the heap, not mapped (and faulted) afresh."""

import subprocess
import sys
import textwrap

import pytest

from engine.cpu_malloc import keep_freed_memory

_PROBE = textwrap.dedent("""
    import resource, sys
    import torch
    from engine.cpu_malloc import keep_freed_memory

    def faults(rounds=8):
        # A step's pattern: several activations of 12 MB live at once, then freed.
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(rounds):
            blocks = [torch.empty(12 << 20, dtype=torch.uint8).fill_(1) for _ in range(3)]
            del blocks
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults(1)
    plain = faults()
    assert keep_freed_memory()
    faults(1)  # the first round grows the heap
    print(plain, faults())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not keep_freed_memory(),
                    reason="mallopt is glibc's")
def test_freed_blocks_are_reused_not_refaulted():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True, timeout=120)
    plain, kept = map(int, out.stdout.split())
    pages = 8 * 3 * (12 << 20) // 4096
    assert plain > pages // 4, (plain, kept)  # glibc's defaults map the blocks afresh
    # Most blocks are reused, and at least half of glibc's faults are gone.
    # By itself the probe refaults no block at all; in full-suite runs on 5
    # December it refaulted 5 of its 24, every time (15360 faults, against
    # 52025-58233 plain), for a reason not found.
    assert kept < pages // 4 and 2 * kept < plain, (plain, kept)


def test_is_idempotent():
    assert keep_freed_memory() == keep_freed_memory()
