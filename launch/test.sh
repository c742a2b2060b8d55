#!/usr/bin/env bash
# Sets up, builds (warnings are errors) and runs every test. Extra arguments go
# to ctest, e.g. -L gpu or -R Gguf.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/launch/setup.sh"
"$root/launch/build.sh" -DDUET_WERROR=ON
cd "${DUET_BUILD_DIR:-$root/build}"
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 ctest --output-on-failure -j "$(nproc)" "$@"
