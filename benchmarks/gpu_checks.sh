#!/usr/bin/env bash
# Every check that needs a GPU, in one run, for a borrowed GPU machine.
#
#   OUT=gpu-results bash benchmarks/gpu_checks.sh
#
# Run from the repository root with a python3 that holds a CUDA build of
# PyTorch and Triton (nothing is installed or downloaded). Writes the GPU
# tests' log, the kernel benchmark's JSON and its printed tables under $OUT,
# within 9 minutes (the limits below); the tables go into docs/benchmarks.md.
# Exits non-zero if either part failed.
set -u -o pipefail
out=${OUT:-gpu-results}
mkdir -p "$out"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' | tee "$out/device.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >> "$out/device.txt" 2>&1
# The compiled kernels against their references (fp8 KV store and decode too),
# cpu_offload_gb streaming weights from pinned host memory, CUDA graphs against eager,
# the quantized matmuls (GPTQ/AWQ/pack-quantized integers, INT8/FP8 W8A16) and
# compressed-tensors models on the GPU against the CPU, and (with two GPUs)
# tensor parallelism over NCCL.
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
    2>&1 | tee "$out/pytest_gpu.log"
tests=$?
timeout 400 python3 benchmarks/kernels_gpu.py --out "$out/kernels_gpu.json" \
    2>&1 | tee "$out/kernels_gpu.log"
bench=$?
echo "gpu tests: exit $tests; kernel benchmark: exit $bench" | tee -a "$out/device.txt"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
