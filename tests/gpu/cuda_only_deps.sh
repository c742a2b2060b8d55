#!/usr/bin/env bash
# Checks that the CUDA-only build (-DDUET_CUDA_ONLY=ON, what tests/gpu/run.sh
# builds on the GPU machine, which has only a compiler, CMake and the CUDA
# toolkit) needs nothing else: it builds it here, where the other libraries
# happen to be installed, and fails if any of its objects included a header
# of MPI, Cap'n Proto, Boost, spdlog, fmt, PCRE2, nlohmann-json, CLI11 or
# GoogleTest (read from the compilers' dependency files), or if it did not
# build. Skips (exit 0, saying so) without nvcc.
#
#   tests/gpu/cuda_only_deps.sh [BUILD_DIR]      (default build-cuda-only)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-$root/build-cuda-only}
export PATH=/usr/local/cuda/bin:$PATH
if ! command -v nvcc >/dev/null; then
  echo "cuda-only deps: no nvcc here; skipped"
  exit 0
fi
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDUET_CUDA_ONLY=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" -DDUET_WERROR=ON >/dev/null
cmake --build "$build" -j "${DUET_JOBS:-$(nproc)}" >/dev/null
forbidden='/(mpi|openmpi|capnp|kj|boost|spdlog|fmt|pcre2|nlohmann|CLI|gtest|gmock)/|/mpi\.h'
found=$(find "$build" -name '*.d' -print0 | xargs -0 grep -lE "$forbidden" || true)
if [ -n "$found" ]; then
  echo "cuda-only deps: these objects include headers the GPU machine does not have:"
  for f in $found; do
    echo "  ${f#"$build"/}: $(grep -ohE "[^ ]*($forbidden)[^ ]*" "$f" | head -3 | tr '\n' ' ')"
  done
  exit 1
fi
echo "cuda-only deps: ok ($(find "$build" -name '*.d' | wc -l) objects, none includes a library beyond CUDA)"
