#!/usr/bin/env bash
# Configures and builds Duet into build/ (Release). Extra arguments go to CMake's
# configure step, e.g. -DDUET_CUDA=OFF or -DDUET_WERROR=ON.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${DUET_BUILD_DIR:-$root/build}
jobs=${DUET_JOBS:-$(nproc)}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build" -j "$jobs"
