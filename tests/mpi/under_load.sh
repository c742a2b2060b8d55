#!/usr/bin/env bash
# Runs a command while N other processes keep the CPUs busy, as CI's machine
# may be while it runs `ctest -j2`: the failover tests must not count a
# healthy instance lost because the machine was loaded (a false loss).
#
# Usage: under_load.sh N COMMAND [ARGS...]
# The busy processes run at nice 0 (a neighbour's build, not a polite
# background job), start before the command and are killed when it ends,
# however it ends. Exits with the command's code.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: under_load.sh N COMMAND [ARGS...]" >&2; exit 2; }
n=$1
shift
pids=()
# shellcheck disable=SC2317 # called from the trap
stop_load() {
  [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
  pids=()
}
trap stop_load EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
for _ in $(seq 1 "$n"); do
  # A shell arithmetic loop: pure CPU, no memory traffic, no output.
  bash -c 'i=0; while :; do i=$((i + 1)); done' &
  pids+=($!)
done
echo "under-load: $n busy processes beside: $*" >&2
code=0
"$@" || code=$?
stop_load
exit "$code"
