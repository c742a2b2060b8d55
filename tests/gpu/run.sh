#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU: builds with CUDA, runs the
# tests labeled `gpu`, and writes every log into the folder given (default
# gpu-logs/). Usage: tests/gpu/run.sh OUT_DIR
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${1:-$root/gpu-logs}
mkdir -p "$out"
build=${DUET_BUILD_DIR:-$root/build-gpu}
{
  nvidia-smi || true
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDUET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 &&
    cmake --build "$build" -j "$(nproc)"
} >"$out/build.log" 2>&1 || { echo "build failed: see $out/build.log"; exit 1; }
(cd "$build" && ctest -L gpu --output-on-failure) >"$out/gpu-tests.log" 2>&1
status=$?
tail -n 20 "$out/gpu-tests.log"
exit $status
