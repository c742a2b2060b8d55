#!/usr/bin/env bash
# The soak (bench/soak.py): a 1 prefill + 1 decode cluster for 20 minutes at
# 80% of its measured saturation, cancellations and disconnects mixed in;
# prints errors, every rank's RSS, KV blocks in use once idle, and TTFT/TPOT
# per minute. Exit 0 when there were no errors, no leaked block and every
# rank's RSS stayed within 5%. Not part of the tests (it takes 22 minutes).
#
# Usage: bench/soak.sh [--duration S] [--load F] [--json FILE] ...
# Environment: DUET_SKIP_SETUP=1, DUET_SKIP_BUILD=1, DUET_BINARY, DUET_MODEL,
# DUET_MPIEXEC as for launch/local.sh.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ "${DUET_SKIP_SETUP:-0}" = 1 ] || "$root/launch/setup.sh"
[ "${DUET_SKIP_BUILD:-0}" = 1 ] || "$root/launch/build.sh" >&2
export DUET_BINARY=${DUET_BINARY:-${DUET_BUILD_DIR:-$root/build}/tools/duet}
export DUET_MODEL=${DUET_MODEL:-${DUET_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf}
export DUET_MPIEXEC=${DUET_MPIEXEC:-mpirun}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
exec "${DUET_VENV:-$root/.cache/venv}/bin/python3" "$root/bench/soak.py" "$@"
