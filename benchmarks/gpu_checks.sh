#!/usr/bin/env bash
# Every check that needs a GPU, in one run, for a borrowed GPU machine.
#
#   OUT=gpu-results bash benchmarks/gpu_checks.sh
#
# Run from the repository root with a python3 that holds a CUDA build of
# PyTorch and Triton and the project's dependencies (nothing is installed or
# downloaded). Writes the GPU tests' log, the kernel benchmark's JSON and its
# printed tables under $OUT, within 9 minutes (the limits below, which
# GPU_TESTS_LIMIT and BENCH_LIMIT, in seconds, can shorten); the tables go into
# docs/benchmarks.md. Exits non-zero if either part failed. On an offline
# machine whose python3 has torch and Triton but not the gRPC/OpenTelemetry
# packages, scripts/gpu_wheels.sh says how to bring them.
set -u -o pipefail
out=${OUT:-gpu-results}
mkdir -p "$out"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' | tee "$out/device.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >> "$out/device.txt" 2>&1
# The compiled kernels against their references (fp8 KV store and decode too),
# cpu_offload_gb streaming weights from pinned host memory, CUDA graphs against eager,
# the quantized matmuls (GPTQ/AWQ/pack-quantized integers, INT8/FP8 W8A16) and
# compressed-tensors models on the GPU against the CPU, disaggregated prefill and
# decode workers on the GPU (gRPC bytes), and with two GPUs, tensor parallelism
# and the torch KV transport over NCCL. A test stuck past 120 s fails alone
# where pytest-timeout is installed.
per_test=$(python3 -c 'import pytest_timeout' 2>/dev/null && echo --timeout=120)
timeout "${GPU_TESTS_LIMIT:-240}" python3 -m pytest -q -rs -m gpu tests/test_gpu.py \
    tests/test_gpu_workers.py -p no:cacheprovider $per_test 2>&1 | tee "$out/pytest_gpu.log"
tests=$?
timeout "${BENCH_LIMIT:-300}" python3 benchmarks/kernels_gpu.py --out "$out/kernels_gpu.json" \
    2>&1 | tee "$out/kernels_gpu.log"
bench=$?
echo "gpu tests: exit $tests; kernel benchmark: exit $bench" | tee -a "$out/device.txt"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
