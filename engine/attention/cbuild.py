"""Build a small C source into a shared library once per machine, and load it.

The CPU kernels are plain C (no torch headers), so a build takes about a
second with the system's ``cc`` and is cached under
``$TANDEM_CACHE_DIR/kernels`` (default ``~/.cache/tandem/kernels``), keyed by
the source, the flags, the compiler and the CPU's feature flags (the code is
built with ``-march=native``). Where no compiler works (a slim container),
``load`` returns None and callers keep to their torch path.

NOTE: the library is built with ``-fopenmp`` and links ``libgomp.so.1`` by
its soname; torch has already loaded its own copy under that name, so the
kernels share torch's OpenMP thread pool and thread count instead of starting
a second pool that would fight it for the cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before any kernel library)

logger = logging.getLogger("engine")

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno")


def _cache_root() -> Path:
    env = os.environ.get("TANDEM_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "tandem"
    return root.expanduser() / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return cc


def load(name: str, source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from ``source`` (with ``extra_flags`` after the
    common ones), or None (logged) when it cannot be built or loaded here."""
    cc = _compiler()
    if cc is None:
        logger.info("no C compiler found: %s kernels fall back to torch ops", name)
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        flags = (*CFLAGS, *extra_flags)
        identity = "\0".join([source, " ".join(flags), version, _cpu_flags()])
        key = hashlib.sha256(identity.encode()).hexdigest()[:16]
        path = _cache_root() / f"{name}-{key}.so"
        if not path.is_file():
            _build(cc, source, flags, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("could not build the %s kernels (%s): falling back to torch ops", name, e)
        return None


def _build(cc: str, source: str, flags: tuple[str, ...], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / "kernel.c", Path(tmp) / "kernel.so"
        src.write_text(source)
        result = subprocess.run([cc, *flags, str(src), "-o", str(lib), "-lm"],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise OSError(f"{cc} failed: {result.stderr.strip()[-2000:]}")
        # Atomic: concurrent processes may build the same library; each renames a whole file.
        os.replace(lib, path)
