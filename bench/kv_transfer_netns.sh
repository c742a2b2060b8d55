#!/usr/bin/env bash
# duet-kv-transfer-bench across three hosts on one machine: every rank in a
# network namespace of its own (tests/mpi/netns/netns_lib.sh), joined by veth
# pairs on a bridge, with MPI restricted to TCP on that subnet:
#
#   host a, 10.77.0.1: mpirun, rank 0 (idle, the coordinator's place)
#   host b, 10.77.0.2: rank 1 (the prefill side, sends the KV)
#   host c, 10.77.0.3: rank 2 (the decode side, receives it; prints the tables)
#
# Why: under a plain `mpirun -np 3` the ranks share a host name and Open MPI
# moves the KV through shared memory, which no two hosts of a cluster do.
# Here every message goes through the kernel's TCP stack and a veth, as
# between hosts, so raw MPI and MpiKvTransfer (and with --model the TTFT a
# transfer adds) are compared over a network path. A veth is not a NIC: no
# wire, no link speed; what it measures is the cost of TCP and of the
# transfer on top of it. After the bench, the bytes host c's veth received
# show that the KV crossed it.
#
# Usage (as root, from anywhere; relative paths are the caller's):
#   bench/kv_transfer_netns.sh [duet-kv-transfer-bench arguments...]
#   e.g. DUET_BUILD_DIR=build-release bench/kv_transfer_netns.sh --tokens 512 --reps 7 \
#          --model models/SmolLM2-135M-Instruct.Q4_1.gguf
# Environment: DUET_BUILD_DIR (default build, at the repository's root),
# DUET_MPIRUN (default mpirun).
# Exit codes: the bench's (mpirun's); 1 when the namespaces cannot be made
# (not root, or not permitted here). The namespaces are always removed, also
# those a killed run of this script or of the netns test left behind.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${DUET_BUILD_DIR:-$root/build}
mpirun=${DUET_MPIRUN:-mpirun}

say() { printf 'kv-transfer-netns: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# shellcheck source=SCRIPTDIR/../tests/mpi/netns/netns_lib.sh
. "$root/tests/mpi/netns/netns_lib.sh"
netns_log() { say "$*"; }

[ -x "$build/bench/duet-kv-transfer-bench" ] ||
  die "no $build/bench/duet-kv-transfer-bench: build it, or name the build in DUET_BUILD_DIR"
# Absolute: the ranks start in other namespaces (same files, same cwd).
bench=$(cd "$build/bench" && pwd)/duet-kv-transfer-bench
command -v "$mpirun" >/dev/null || die "no $mpirun (DUET_MPIRUN)"
netns_preflight || die "$NETNS_ERROR"

work=$(mktemp -d)
run=""
# shellcheck disable=SC2317 # called from the trap
cleanup() {
  if [ -n "$run" ] && kill -0 "$run" 2>/dev/null; then
    kill -TERM "$run" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$run" 2>/dev/null || break; sleep 0.1; done
  fi
  netns_down  # kills whatever is left in the namespaces
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

netns_up "duetnet$$" a b c || die "cannot set up the network namespaces${NETNS_ERROR:+: $NETNS_ERROR}"
netns_hostfile "$work/hosts" 1

# One slot per host, filled in hostfile order: rank 0 on a, 1 on b, 2 on c.
# No binding: each "host" would bind its rank to the same core 0.
args=(--hostfile "$work/hosts" --map-by slot -np 3 --bind-to none)
[ "$(id -u)" -ne 0 ] || args+=(--allow-run-as-root)
netns_mpirun_args args
netns_mpi_tcp_args args
on_a=()
netns_on_host on_a a

say "rank 0 on host a ($(netns_address a)), rank 1 on b ($(netns_address b)), rank 2 on c" \
  "($(netns_address c)); MPI: TCP on $NETNS_SUBNET only"
rx_c=$(netns_veth_bytes c rx)
# In the background, so that a signal to this script is handled at once.
"${on_a[@]}" "$mpirun" "${args[@]}" "$bench" "$@" &
run=$!
code=0
wait "$run" || code=$?
run=""
say "host c's veth received $(($(netns_veth_bytes c rx) - rx_c)) bytes during the bench"
[ "$code" -eq 0 ] || say "the bench exited with code $code"
exit "$code"
