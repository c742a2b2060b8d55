#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU and the CUDA toolkit (no
# other package needed, no network): a 10-second probe of the GPU, a
# CUDA-only build (-DDUET_CUDA_ONLY=ON: the core, the kernels, the model and
# these checks), the op-consistency checks (every CUDA op against its CPU
# twin), the end-to-end model check (GPU against CPU), the KV links, tensor
# parallelism over NCCL (two GPUs or more), and the GPU benchmark.
# Logs and a JSON summary (summary.json) go into the folder given.
#
#   tests/gpu/run.sh OUT_DIR
#
# Environment: DUET_MODEL (default models/SmolLM2-135M-Instruct.Q4_1.gguf, as
# launch/setup.sh fetches it), DUET_BUILD_DIR (default build-gpu),
# CUDA_ARCHS (default 90). Exit status: 0 when every step passed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${1:-$root/gpu-logs}
mkdir -p "$out"
out=$(cd "$out" && pwd)
build=${DUET_BUILD_DIR:-$root/build-gpu}
model=${DUET_MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
archs=${CUDA_ARCHS:-90}
start=$(date +%s)
declare -A status

say() { printf '[gpu-check %3ds] %s\n' $(($(date +%s) - start)) "$*"; }

# 1. Probe: is there a GPU that answers, within 10 seconds?
if timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
  --format=csv >"$out/probe.log" 2>&1; then
  status[probe]=ok
  say "probe: $(tail -n +2 "$out/probe.log" | head -1)"
else
  status[probe]=failed
  say "probe failed: see $out/probe.log"
fi

# 2. The CUDA-only build.
export PATH=/usr/local/cuda/bin:$PATH
generator=()
# Ninja when there is one, unless the build folder was made with another generator.
command -v ninja >/dev/null && [ ! -f "$build/CMakeCache.txt" ] && generator=(-G Ninja)
if { cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DDUET_CUDA_ONLY=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$archs" && cmake --build "$build" -j "$(nproc)"; } \
  >"$out/build.log" 2>&1; then
  status[build]=ok
  say "build: ok"
else
  status[build]=failed
  say "build failed: tail of $out/build.log:"
  tail -n 30 "$out/build.log"
fi

# 3. The checks, each with its own log.
run_check() {
  local name=$1
  shift
  if [ "${status[build]}" != ok ]; then
    status[$name]=not-run
    return
  fi
  local rc=0
  (cd "$build" && timeout 300 "$@") >"$out/$name.log" 2>&1 || rc=$?
  case $rc in
    0) status[$name]=passed ;;
    77) status[$name]=skipped ;;
    *) status[$name]="failed (exit $rc)" ;;
  esac
  say "$name: ${status[$name]}"
  grep -E "FAILED|error|skipped" "$out/$name.log" | head -20
}
export DUET_MODEL="$model"
run_check ops tests/gpu/cuda_ops_check
run_check matmul tests/gpu/cuda_matmul_check
run_check attention tests/gpu/cuda_attention_check
run_check kv_rows tests/gpu/cuda_kv_rows_check
run_check sampling tests/gpu/cuda_sampling_check
run_check nccl tests/gpu/cuda_nccl_check
run_check model tests/gpu/cuda_model_check
run_check nccl_kv tests/gpu/cuda_nccl_kv_check
run_check ipc_kv tests/gpu/cuda_ipc_kv_check
run_check tp tests/gpu/cuda_tp_check

# 4. The benchmark.
bench_args=(--json "$out/bench.json")
[ -f "$model" ] && bench_args+=(--model "$model")
run_check bench tests/gpu/duet-cuda-bench "${bench_args[@]}"
[ -f "$out/bench.log" ] && cat "$out/bench.log"

# 5. The summary.
{
  printf '{\n  "seconds": %d,\n  "model": "%s",\n  "steps": {' $(($(date +%s) - start)) \
    "$([ -f "$model" ] && basename "$model" || echo absent)"
  sep=""
  for step in probe build ops matmul attention kv_rows sampling nccl model nccl_kv ipc_kv tp bench; do
    printf '%s\n    "%s": "%s"' "$sep" "$step" "${status[$step]:-not-run}"
    sep=","
  done
  printf '\n  },\n  "bench": %s\n}\n' "$([ -s "$out/bench.json" ] && cat "$out/bench.json" || echo null)"
} >"$out/summary.json"
say "summary: $out/summary.json"
for step in probe build ops matmul attention kv_rows sampling nccl model nccl_kv ipc_kv tp bench; do
  # tp skips on a machine with one GPU (it needs one per rank)
  [ "$step" = tp ] && [ "${status[$step]:-}" = skipped ] && continue
  case ${status[$step]:-not-run} in ok | passed) ;; *) exit 1 ;; esac
done
exit 0
