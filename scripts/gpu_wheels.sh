#!/usr/bin/env bash
# Wheels for a GPU machine that has CUDA builds of torch and Triton but not
# the rest of what benchmarks/gpu_checks.sh imports, and no package index
# (an offline image). Run where pip reaches an index; carry the folder over;
# there, before gpu_checks.sh:
#
#   bash scripts/gpu_wheels.sh .whl [python version, default 3.12]
#   # on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site OUT=gpu-results bash benchmarks/gpu_checks.sh
#
# The versions are this project's .venv's, so the generated gRPC code and
# the protobuf runtime agree. About 11 MiB. The engine and kernel tests need
# none of these; the worker test (tests/test_gpu_workers.py) needs them all.
set -euo pipefail
dest=${1:?usage: gpu_wheels.sh DEST_DIR [PYTHON_VERSION]}
py=${2:-3.12}
here=$(cd "$(dirname "$0")/.." && pwd)
pip=("$here/.venv/bin/python" -m pip)
packages=(protobuf grpcio grpcio-tools grpcio-health-checking grpcio-reflection
          googleapis-common-protos opentelemetry-api opentelemetry-sdk
          opentelemetry-semantic-conventions opentelemetry-instrumentation
          opentelemetry-instrumentation-grpc opentelemetry-exporter-otlp-proto-grpc
          opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
          opentelemetry-proto)
pins=()
for p in "${packages[@]}"; do
    version=$("${pip[@]}" show "$p" 2>/dev/null | awk '/^Version:/ {print $2}')
    [ -n "$version" ] || { echo "$p is not in .venv: run make install first" >&2; exit 1; }
    pins+=("$p==$version")
done
mkdir -p "$dest"
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "${pins[@]}"
echo "wheels for python $py in $dest: $(ls "$dest" | wc -l) files"
