"""Timing and peak figures shared by the GPU benchmarks: each device's peak
bandwidth and FLOP rate, a kernel's median time, and for the launch sweeps
(prefill_tiles_gpu.py, quant_tiles_gpu.py) their command line and a
checked, timed launch."""

from __future__ import annotations

import argparse
import os

import torch

# Substring of torch.cuda.get_device_name() -> (HBM bytes/s, dense bf16 FLOP/s).
# More specific names first.
PEAKS = [
    ("H200", 4.8e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),  # SXM, "NVIDIA H100 80GB HBM3"
    ("GH200", 4.0e12, 989e12),
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12),  # 40GB
    ("L40S", 0.864e12, 362e12),
    ("L4", 0.3e12, 121e12),
    ("A10G", 0.6e12, 70e12),
    ("RTX 4090", 1.008e12, 165e12),
]


def device_peaks(name: str) -> tuple[float | None, float | None]:
    for key, bw, flops in PEAKS:
        if key in name:
            return bw, flops
    return None, None


def sweep_args(doc: str, default_out: str) -> argparse.Namespace:
    """A launch sweep's command line (``--out``), once a GPU that compiles
    the kernels is there; seeds torch. For prefill_tiles_gpu.py and
    quant_tiles_gpu.py."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=default_out, help="JSON results file")
    args = parser.parse_args()
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("needs a CUDA GPU and TRITON_INTERPRET unset")
    torch.manual_seed(0)
    return args


def time_ms(fn) -> float:
    import triton.testing

    # do_bench clears the L2 cache between runs and times with CUDA events.
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def checked_ms(fn, ref: torch.Tensor, tol: float = 2e-2) -> dict:
    """For a launch sweep: ``fn()``'s relative error against ``ref`` and, if
    under ``tol``, its time; or why it has none (a launch that does not
    compile, e.g. out of shared memory, or a wrong result)."""
    try:
        err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
        if not err < tol:
            return {"rel_err": err, "error": f"relative error {err:.3g}"}
        return {"rel_err": err, "ms": time_ms(fn)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).partition(chr(10))[0][:160]}"}
