#!/usr/bin/env bash
# The GPU run: everything the CUDA code can be asked on one machine with an
# NVIDIA GPU and the CUDA toolkit, unattended, without network access, from a
# tree without model files, in at most DUET_GPU_BUDGET_S seconds (600) with
# the build. Steps, in order:
#
#   probe       the GPU (nvidia-smi: name, memory, driver, compute mode, MIG),
#               nvcc, where NCCL is (the toolkit, the linker's cache, a Python
#               wheel's libnccl.so.2), the default model
#   configure   the CUDA-only build (-DDUET_CUDA_ONLY=ON: only the toolkit is
#               needed); when it fails the run stops there, saying why
#   build       every target, going on past a broken one (ninja -k 0, make -k)
#   ops .. tp   every GPU check (cuda_*_check), the default model's cases
#               skipped, saying so, when it is absent
#   bench       duet-cuda-bench --quick on the default model, else a tiny fixture
#   synth       a synthetic Llama-3-8B, Q4_0 (tests/gpu/synthetic_model.py),
#               written while the build runs
#   bench_8b    duet-cuda-bench on it: decode at batch 1 and 64 against the
#               device copy bandwidth, a 2048-token prefill against the GEMM rate
#   ipc_kv_8b   cuda_ipc_kv_check on it: its KV between two processes, and the
#               IPC payload rate against a device copy of the same payloads
#
# Everything it writes goes into one archive, DIR/gpu-run-TIME.tar.gz (at
# most 20 MB: every log, steps.tsv, the probe, the bench JSON, summary.txt and
# summary.json), repacked after every step so that a run cut short still
# brings back what it learned; the summary (step, exit code, seconds, key
# figures) goes to stdout at the end, progress to stderr. Apart from it only
# the build folder stays (the synthetic model is deleted).
#
#   tests/gpu/run.sh DIR
#   tests/gpu/run.sh --dry-run DIR       (or DUET_GPU_DRY_RUN=1)
#
# The dry run is the rehearsal on a machine without a GPU (ctest runs it):
# the probe, the generator at a small shape, the summary and the packing;
# the build and every GPU step are replaced by a row saying they were skipped.
# Without --dry-run, on a machine without an NVIDIA GPU it says so in one line
# and exits 0, having checked and written nothing.
#
# Exit status: 0 when no step failed (a skip with its reason is no failure),
# 1 otherwise. Environment: DUET_MODEL (default models/SmolLM2-135M-Instruct.
# Q4_1.gguf), DUET_BUILD_DIR (build-gpu), CUDA_ARCHS (the GPU's compute
# capability, else 90), DUET_GPU_BUDGET_S (600; a step that would not fit is
# skipped, saying so), DUET_GPU_SYNTHETIC ("SHAPE TYPE [LAYERS]", default
# "llama3-8b q4_0"; the dry run's "smollm2-135m q4_0 2").
set -uo pipefail

dry_run=${DUET_GPU_DRY_RUN:-0}
if [ "${1:-}" = --dry-run ]; then
  dry_run=1
  shift
fi
if [ $# -ne 1 ]; then
  echo "usage: tests/gpu/run.sh [--dry-run] DIR" >&2
  exit 2
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
budget=${DUET_GPU_BUDGET_S:-600}
start_ms=$(date +%s%3N)

# A GPU answers nvidia-smi, or at least has a device node. An nvidia-smi
# that hangs (a wedged driver) is asked nothing more.
smi_rc=0
gpu_listing=$(timeout 10 nvidia-smi -L 2>&1) || smi_rc=$?
smi() { [ "$smi_rc" -ne 124 ] && timeout 10 nvidia-smi "$@"; }
if ! grep -q '^GPU ' <<<"$gpu_listing" && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1 && [ "$dry_run" != 1 ]; then
  why="no nvidia-smi, no /dev/nvidia0"
  command -v nvidia-smi >/dev/null && why="nvidia-smi -L: $(head -1 <<<"$gpu_listing")"
  echo "gpu-run: no NVIDIA GPU on this machine ($why): nothing checked"
  exit 0
fi

mkdir -p "$1" || exit 2
dir=$(cd "$1" && pwd)
archive=$dir/gpu-run-$(date -u +%Y%m%d-%H%M%S).tar.gz
work=$(mktemp -d "$dir/.gpu-run.XXXXXX")
build=${DUET_BUILD_DIR:-$root/build-gpu}
synth_dir=$build/synthetic # beside the build: the disk the probe reports
synth_model=""
synth_pid=""
cleanup() {
  [ -n "$synth_pid" ] && kill "$synth_pid" 2>/dev/null
  [ -n "$synth_model" ] && rm -f "$synth_model"
  rmdir "$synth_dir" "$build" 2>/dev/null # only when nothing else is there (a dry run)
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

elapsed_ms() { echo $(($(date +%s%3N) - start_ms)); }
seconds_since() { awk -v ms=$(($(date +%s%3N) - $1)) 'BEGIN { printf "%.1f", ms / 1000 }'; }
say() { printf '[gpu-run %4ds] %s\n' $(($(elapsed_ms) / 1000)) "$*" >&2; }

# steps.tsv: step, exit code, seconds, status, note (one line each).
printf 'step\texit\tseconds\tstatus\tnote\n' >"$work/steps.tsv"
record_row() {
  local note=${5//$'\t'/ }
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${note//$'\n'/ }" >>"$work/steps.tsv"
  say "$1: $4${5:+ ($note)}"
}
record() {
  record_row "$@"
  pack
}

# Logs over LIMIT bytes keep their first quarter and last half of it.
cut_logs() {
  local f limit=$1
  for f in "$work"/*.log; do
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt "$limit" ] || continue
    { head -c $((limit / 4)) "$f"; printf '\n[... cut to fit the archive ...]\n'; tail -c $((limit / 2)) "$f"; } >"$f.cut"
    mv "$f.cut" "$f"
  done
}

# The archive, rewritten whole (at most 20 MB; a log still being written may
# change under tar, which is no error).
pack() {
  cut_logs $((2 << 20))
  summarize >"$work/summary.txt" 2>"$work/summary.err"
  local rc=0
  tar -C "$work" --warning=no-file-changed -czf "$archive.part" . || rc=$?
  [ "$rc" -le 1 ] && mv "$archive.part" "$archive"
  if [ "$(stat -c %s "$archive" 2>/dev/null || echo 0)" -gt $((20 << 20)) ]; then
    cut_logs $((256 << 10))
    tar -C "$work" --warning=no-file-changed -czf "$archive.part" . ; mv "$archive.part" "$archive"
  fi
}

summarize() {
  if command -v python3 >/dev/null; then
    python3 "$here/run_summary.py" "$work" --budget "$budget" --elapsed $(($(elapsed_ms) / 1000))
  else
    echo "gpu-run: no python3 here, so no figures; the steps:"
    column -t -s $'\t' "$work/steps.tsv" 2>/dev/null || cat "$work/steps.tsv"
  fi
}

# Seconds left for a step: the budget less what has gone and what packing needs.
seconds_left() { echo $((budget - $(elapsed_ms) / 1000 - 15)); }

# run_step NAME LIMIT COMMAND...: runs COMMAND in the build folder with its
# output in NAME.log, for at most LIMIT seconds (less when the budget is
# nearly spent), and records its row. Exit 77 is a skip, 124 a timeout.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left
  left=$(seconds_left)
  if [ "$left" -lt 10 ]; then
    record "$name" - 0 skipped "no time left of the $budget s budget"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "$name: running (at most $limit s)"
  local t0 rc=0
  t0=$(date +%s%3N)
  (cd "$build" && timeout -k 10 "$limit" "$@") >"$work/$name.log" 2>&1 || rc=$?
  local seconds
  seconds=$(seconds_since "$t0")
  local status
  case $rc in
    0) status=passed ;;
    77) status=skipped ;;
    124 | 137) status="timed out" ;;
    *) status=failed ;;
  esac
  record "$name" "$rc" "$seconds" "$status" "$(check_note "$work/$name.log")"
}

# What a check's log says in a few words: its cases, and its first failure.
check_note() {
  local ok fail skipped first
  ok=$(grep -c '^\[   ok \]' "$1")
  fail=$(grep -c '^\[ FAIL \]' "$1")
  skipped=$(grep -ci 'skipped' "$1")
  first=$(grep -m1 -E 'FAILED|error:|what\(\)|Error' "$1" | cut -c1-160)
  if [ "$ok" -gt 0 ] || [ "$fail" -gt 0 ]; then
    printf '%s ok, %s failed, %s lines say skipped' "$ok" "$fail" "$skipped"
  fi
  [ -n "$first" ] && printf '; first: %s' "$first"
  [ "$ok" -eq 0 ] && [ "$fail" -eq 0 ] && [ -z "$first" ] && tail -n 1 "$1" | cut -c1-160
}

skip_rest() {
  local step
  for step in "$@"; do record_row "$step" - 0 skipped "$reason"; done
  pack
}

checks=(ops matmul attention kv_rows sampling nccl model nccl_kv ipc_kv tp)
declare -A check_timeout=([ops]=90 [matmul]=90 [attention]=90 [kv_rows]=60 [sampling]=60
  [nccl]=60 [model]=150 [nccl_kv]=60 [ipc_kv]=120 [tp]=90)

# --------------------------------------------------------------------- probe
probe() {
  local t0 nvcc cuda_root lib header="" version="" where
  t0=$(date +%s%3N)
  local status_table
  status_table=$(smi 2>&1)
  {
    echo "== nvidia-smi -L (exit $smi_rc)"
    echo "$gpu_listing"
    echo "== nvidia-smi"
    echo "$status_table"
    echo "== nvidia-smi -q"
    smi -q 2>&1
  } >"$work/probe.log"
  # One query per field: an older driver that lacks one fails only it.
  local field value gpu_row=""
  for field in name memory.total driver_version compute_mode mig.mode.current compute_cap; do
    value=$(smi --query-gpu="$field" --format=csv,noheader 2>/dev/null | head -1)
    [ -n "$value" ] || continue
    case $field in
      driver_version) value="driver $value" ;;
      compute_mode) value="compute mode $value" ;;
      mig.mode.current) value="MIG $value" ;;
      compute_cap) value="sm_${value/./}" ;;
    esac
    gpu_row+=${gpu_row:+, }$value
  done
  {
    echo "gpu_count=$(grep -c '^GPU ' <<<"$gpu_listing")"
    echo "gpu=${gpu_row:-none}"
    echo "driver_cuda=$(grep -o 'CUDA Version: [0-9.]*' <<<"$status_table" | grep -o '[0-9.]*$')"
  } >"$work/probe.env"

  nvcc=$(command -v nvcc || ls -d /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | sort -V | tail -1)
  cuda_root=""
  if [ -n "$nvcc" ] && [ -x "$nvcc" ]; then
    nvcc=$(readlink -f "$nvcc") # CMake finds the toolkit from where nvcc really is
    cuda_root=$(cd "$(dirname "$nvcc")/.." && pwd)
    echo "nvcc=$nvcc" >>"$work/probe.env"
    echo "nvcc_version=$("$nvcc" --version | grep -o 'release [0-9.]*' | cut -d' ' -f2)" >>"$work/probe.env"
  else
    echo "nvcc=" >>"$work/probe.env"
  fi

  # NCCL: the toolkit's, the dynamic linker's, a Python wheel's (nvidia-nccl-*:
  # lib/libnccl.so.2 only), or anywhere on this disk.
  lib=$(ls "$cuda_root"/lib64/libnccl.so* "$cuda_root"/lib/libnccl.so* \
    "$cuda_root"/targets/*/lib/libnccl.so* 2>/dev/null | head -1)
  where=toolkit
  if [ -z "$lib" ]; then
    lib=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so/ { print $NF; exit }')
    where="linker cache"
  fi
  if [ -z "$lib" ] && command -v python3 >/dev/null; then
    lib=$(python3 -c 'import glob, nvidia.nccl as m
print(next(iter(glob.glob(m.__path__[0] + "/lib/libnccl.so*")), ""))' 2>/dev/null)
    where="python wheel"
  fi
  if [ -z "$lib" ]; then
    lib=$(timeout 15 find / -xdev \( -path /proc -o -path /sys \) -prune -o -name 'libnccl.so*' -print 2>/dev/null | head -1)
    where="found on disk"
  fi
  if [ -n "$lib" ]; then
    lib=$(readlink -f "$lib")
    local inc
    for inc in "$(dirname "$lib")/../include" "$cuda_root/include"; do
      [ -f "$inc/nccl.h" ] && header=$(cd "$inc" && pwd)/nccl.h && break
    done
    [ -n "$header" ] && version=$(awk '/define NCCL_(MAJOR|MINOR|PATCH) / { v = v (v ? "." : "") $3 } END { print v }' "$header")
    if [ -z "$version" ] && command -v python3 >/dev/null; then
      version=$(python3 -c 'import ctypes, sys
v = ctypes.c_int(); ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v)); v = v.value
print(f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v >= 10000 else v)' "$lib" 2>/dev/null)
    fi
  else
    where=none
  fi
  {
    echo "nccl_lib=$lib"
    echo "nccl_where=$where"
    echo "nccl_header=${header:-none: the vendored one (third_party/nccl)}"
    echo "nccl_version=$version"
    echo "python3=$(python3 --version 2>&1 | cut -d' ' -f2)"
    echo "cmake=$(cmake --version 2>/dev/null | head -1 | awk '{ print $3 }')"
    echo "ninja=$(ninja --version 2>/dev/null)"
    echo "cores=$(nproc)"
    echo "memory_gib=$(awk '/MemTotal/ { printf "%d", $2 / 1048576 }' /proc/meminfo)"
    echo "disk_free_gib=$(df -P "$root" | awk 'NR == 2 { printf "%d", $4 / 1048576 }')"
    echo "default_model=$(default_model)"
  } >>"$work/probe.env"
  cat "$work/probe.env" >>"$work/probe.log"
  nvcc_path=$nvcc
  nccl_lib=$lib
  nccl_header=$header
  record probe 0 "$(seconds_since "$t0")" done \
    "${gpu_row:-no GPU}; nvcc ${nvcc:-absent}; NCCL ${version:-?} ($where)"
}

# The default model's path when it is there, else nothing.
default_model() {
  local model=${DUET_MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
  [ -f "$model" ] && echo "$model"
}

# ----------------------------------------------------------------- the steps
nvcc_path="" nccl_lib="" nccl_header=""
say "work in $work, archive $archive, budget $budget s$([ "$dry_run" = 1 ] && echo ', dry run')"
probe

model=$(default_model)
if [ -n "$model" ]; then
  export DUET_MODEL=$model
else
  # Never a path that is not there: the checks would fail on it, not skip.
  say "no default model (${DUET_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}): its cases skip, saying so"
  unset DUET_MODEL
fi
read -r synth_shape synth_type synth_layers <<<"${DUET_GPU_SYNTHETIC:-$([ "$dry_run" = 1 ] && echo 'smollm2-135m q4_0 2' || echo 'llama3-8b q4_0')}"

# The synthetic model, in the background: it needs a core and the disk, the
# build the other cores.
start_synth() {
  if ! command -v python3 >/dev/null; then
    record synth - 0 skipped "no python3"
    return
  fi
  if ! mkdir -p "$synth_dir"; then
    record synth - 0 failed "cannot make $synth_dir"
    return
  fi
  synth_model=$synth_dir/$synth_shape-$synth_type.gguf
  # Its own seconds go to synth.seconds: the run waits for it only later.
  (
    t0=$(date +%s%3N)
    python3 "$here/synthetic_model.py" --shape "$synth_shape" --type "$synth_type" \
      ${synth_layers:+--layers "$synth_layers"} --out "$synth_model"
    rc=$?
    seconds_since "$t0" >"$work/synth.seconds"
    exit "$rc"
  ) >"$work/synth.log" 2>&1 &
  synth_pid=$!
}

finish_synth() {
  [ -n "$synth_pid" ] || return 1
  local rc=0
  wait "$synth_pid" || rc=$?
  synth_pid=""
  local seconds
  seconds=$(cat "$work/synth.seconds" 2>/dev/null || echo -)
  if [ "$rc" -eq 0 ]; then
    record synth 0 "$seconds" passed "$(tail -n 1 "$work/synth.log" | sed 's/^wrote [^:]*: //')"
  else
    record synth "$rc" "$seconds" failed "$(tail -n 1 "$work/synth.log")"
  fi
  return "$rc"
}

gpu_steps=(build "${checks[@]}" bench bench_8b ipc_kv_8b)
if [ "$dry_run" = 1 ]; then
  start_synth
  finish_synth
  reason="dry run: needs the GPU" skip_rest configure "${gpu_steps[@]}"
  rm -f "$synth_model"
  say "done"
  summarize
  exit 0
fi

# Configure: a failure stops the run within a minute.
archs=${CUDA_ARCHS:-$(grep '^gpu=' "$work/probe.env" | grep -o 'sm_[0-9]*' | cut -c4-)}
archs=${archs:-90}
configure_args=(-S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDUET_CUDA_ONLY=ON
  -DCMAKE_CUDA_ARCHITECTURES="$archs")
[ -n "$nvcc_path" ] && configure_args+=(-DCMAKE_CUDA_COMPILER="$nvcc_path")
[ -n "$nccl_lib" ] && configure_args+=(-DNCCL_LIBRARY="$nccl_lib")
[ -n "$nccl_header" ] && configure_args+=(-DNCCL_INCLUDE_DIR="$(dirname "$nccl_header")")
command -v ninja >/dev/null && [ ! -f "$build/CMakeCache.txt" ] && configure_args+=(-G Ninja)
[ -n "$nccl_lib" ] && export LD_LIBRARY_PATH=$(dirname "$nccl_lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
mkdir -p "$build"
t0=$(date +%s%3N)
rc=0
timeout 60 cmake "${configure_args[@]}" >"$work/configure.log" 2>&1 || rc=$?
seconds=$(seconds_since "$t0")
if [ "$rc" -ne 0 ]; then
  # The first error's message: the indented lines under its "CMake Error" line.
  why=$(awk '/^CMake Error/ { on = 1; next }
    on && /^[^ ]/ { exit }
    on && NF { sub(/^ +/, ""); text = text (text ? " " : "") $0 }
    END { print text }' "$work/configure.log" | cut -c1-200)
  [ "$rc" -eq 124 ] && why="no answer in 60 s"
  echo "gpu-run: configure failed (exit $rc): ${why:-see configure.log}" >&2
  record configure "$rc" "$seconds" failed "${why:-see configure.log}"
  reason="configure failed" skip_rest "${gpu_steps[@]}"
  summarize
  exit 1
fi
record configure 0 "$seconds" passed "sm_$archs, $(grep -m1 -o 'Duet CUDA backend: .*' "$work/configure.log")"

start_synth

# Build everything it can: one broken target does not hide the others.
if grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja' "$build/CMakeCache.txt"; then
  keep_going=(-k 0)
else
  keep_going=(-k)
fi
# It may take all but a minute of what is left: the checks of what built.
# The executables of an earlier build go first, so that whatever is there
# afterwards is this build's (a broken check is then missing, not stale).
rm -f "$build"/tests/gpu/cuda_*_check "$build/tests/gpu/duet-cuda-bench"
t0=$(date +%s%3N)
limit=$(($(seconds_left) - 60))
[ "$limit" -lt 60 ] && limit=60
rc=0
say "build: running (at most $limit s, $(nproc) jobs)"
timeout -k 10 "$limit" cmake --build "$build" -j "$(nproc)" -- "${keep_going[@]}" >"$work/build.log" 2>&1 || rc=$?
seconds=$(seconds_since "$t0")
broken=$(grep -E '^FAILED: |\*\*\* \[' "$work/build.log" | grep -oE '[A-Za-z0-9_+-]+\.(cu|cpp)\.o' |
  sed 's/\.o$//' | sort -u | paste -sd ' ' -)
case $rc in
  0) record build 0 "$seconds" passed "" ;;
  124 | 137) record build "$rc" "$seconds" "timed out" "what built is checked" ;;
  *) record build "$rc" "$seconds" failed "broken: ${broken:-see build.log}" ;;
esac

for check in "${checks[@]}"; do
  binary=tests/gpu/cuda_${check}_check
  if [ ! -x "$build/$binary" ]; then
    record "$check" - 0 "not built" "$binary is missing (build.log)"
    continue
  fi
  run_step "$check" "${check_timeout[$check]}" "$binary"
done

bench_model=${model:-$root/tests/fixtures/tiny_gpu/tiny_gpu_q8_0_gqa_tied.gguf}
if [ -x "$build/tests/gpu/duet-cuda-bench" ]; then
  run_step bench 120 tests/gpu/duet-cuda-bench --quick --model "$bench_model" --json "$work/bench.json"
else
  record bench - 0 "not built" "duet-cuda-bench is missing (build.log)"
fi

if finish_synth; then
  if [ -x "$build/tests/gpu/duet-cuda-bench" ]; then
    run_step bench_8b 240 tests/gpu/duet-cuda-bench --model "$synth_model" --prefill-tokens 2048 \
      --json "$work/bench_8b.json"
  else
    record bench_8b - 0 "not built" "duet-cuda-bench is missing (build.log)"
  fi
  if [ -x "$build/tests/gpu/cuda_ipc_kv_check" ]; then
    DUET_MODEL=$synth_model run_step ipc_kv_8b 180 tests/gpu/cuda_ipc_kv_check
  else
    record ipc_kv_8b - 0 "not built" "cuda_ipc_kv_check is missing (build.log)"
  fi
else
  reason="no synthetic model (synth.log)" skip_rest bench_8b ipc_kv_8b
fi
rm -f "$synth_model"

say "done"
summarize
# Failed: any row whose status is neither passed, skipped nor done.
awk -F'\t' 'NR > 1 && $4 != "passed" && $4 != "skipped" && $4 != "done" { bad = 1 } END { exit bad }' \
  "$work/steps.tsv"
