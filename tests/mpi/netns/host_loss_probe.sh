#!/usr/bin/env bash
# What Open MPI 4.1 does when a whole host is lost: a cluster across four
# hosts that are network namespaces (netns_lib.sh), started as
# launch/hostfile.sh starts one (mpirun --enable-recovery, MPI over TCP on the
# subnet), one rank a host:
#
#   host a: mpirun, rank 0 (the coordinator)   host b: rank 1 (prefill)
#   host c: rank 2 (decode)                    host d: rank 3 (decode)
#
# With four streaming completions in flight, host d is lost in one of two
# ways, then the probe watches for --watch seconds (default 30) and reports
# what happened: whether mpirun and each surviving rank still run, what
# mpirun and the coordinator logged, how the streams ended, what /health says,
# and whether a new request is answered.
#
#   kill       every process of host d (its Open MPI daemon, orted, and rank 3)
#              gets SIGKILL: the host's kernel closes their sockets (a crash
#              of the processes, the machine still up);
#   partition  host d's port on the switch goes down: nothing more arrives
#              from it and nothing is closed (a power loss or a cut cable).
#
# A probe, not a test: it prints its findings and exits 0 once it could make
# them (1 when the cluster did not start, 77 without root or namespaces).
# docs/FAILURES.md keeps what it found.
#
# Usage: host_loss_probe.sh kill|partition [--watch SECONDS]
# Environment: DUET_BINARY, DUET_MODEL, DUET_MPIRUN as for netns_serve_test.sh.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../.." && pwd)
duet=${DUET_BINARY:-${DUET_BUILD_DIR:-$root/build}/tools/duet}
model=${DUET_MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
mode=${1:-}
watch=30
[ "${2:-}" != --watch ] || watch=$3
case $mode in kill | partition) ;; *) sed -n 's/^# \{0,1\}//; /^Usage:/,/^Environment:/p' "$0" >&2; exit 2 ;; esac

say() { printf 'host-loss: %s\n' "$*" >&2; }
report() { printf '%s\n' "$*"; }

# shellcheck source=SCRIPTDIR/netns_lib.sh
. "$here/netns_lib.sh"
netns_log() { say "$*"; }
netns_preflight || { code=$?; say "$NETNS_ERROR"; exit "$code"; }

work=$(mktemp -d)
cluster=""
# shellcheck disable=SC2317 # called from the trap
cleanup() {
  [ -z "$cluster" ] || kill -KILL "$cluster" 2>/dev/null || true
  netns_down
  rm -rf "$work"
}
trap cleanup EXIT

netns_up "duetnet$$" a b c d || { code=$?; say "$NETNS_ERROR"; exit "$code"; }
netns_hostfile "$work/hosts"
ns_a=$(netns_namespace a)
netns_start_cluster "$duet" "$model" "$work/hosts" "$work/cluster.out" "$work/cluster.log" \
  1 2 --kv-cache-mem 256MiB
cluster=$NETNS_CLUSTER
deadline=$((SECONDS + 180))
until grep -qs '^http listening on ' "$work/cluster.out"; do
  if ! kill -0 "$cluster" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
    tail -n 40 "$work/cluster.log" >&2
    say "the cluster did not start"
    exit 1
  fi
  sleep 0.2
done
url=http://$(sed -n 's/^http listening on //p' "$work/cluster.out")

# Pids of the processes on host $1 whose command line matches $2.
on_host() { ip netns pids "$(netns_namespace "$1")" | while read -r p; do
  tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- "$2" && echo "$p"; done || true; }
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null && echo alive || echo gone; }
stream() {  # $1: index; the stream's SSE body into work/stream.$1
  ip netns exec "$ns_a" curl -sS -N --max-time $((watch + 60)) -H 'Content-Type: application/json' \
    -d "{\"prompt\": \"Story number $1: once upon a time\", \"max_tokens\": 160, \"temperature\": 0, \"ignore_eos\": true, \"stream\": true}" \
    "$url/v1/completions" >"$work/stream.$1" 2>&1 || true
}
health() { ip netns exec "$ns_a" curl -sS --max-time 10 -w ' (HTTP %{http_code})' "$url/health" 2>&1 || true; }

mpirun_pid=$(on_host a "mpirun" | head -n 1)
coordinator=$(on_host a "duet serve" | head -n 1)
rank1=$(on_host b "duet serve" | head -n 1)
rank2=$(on_host c "duet serve" | head -n 1)
say "cluster up: $url; host d's processes: $(on_host d . | tr '\n' ' ')"
streams=()
for i in 1 2 3 4; do stream "$i" & streams+=($!); done
sleep 3

lost_at=$(date +%s.%N)
if [ "$mode" = kill ]; then
  # shellcheck disable=SC2046 # a list of pids
  kill -KILL $(ip netns pids "$(netns_namespace d)")
else
  ip -n "$(netns_namespace switch)" link set dev port-d down
fi
say "host d lost ($mode)"
sleep "$watch"

report "## host d lost by $mode; after ${watch} s:"
report "mpirun: $(alive "$mpirun_pid"); rank 0 (coordinator): $(alive "$coordinator");" \
  "rank 1 (prefill, host b): $(alive "$rank1"); rank 2 (decode, host c): $(alive "$rank2")"
report "/health: $(health)"
reply=$(ip netns exec "$ns_a" curl -sS --max-time 60 -w ' (HTTP %{http_code})' \
  -H 'Content-Type: application/json' \
  -d '{"prompt": "A new request", "max_tokens": 8, "temperature": 0}' "$url/v1/completions" 2>&1 || true)
report "a new request: ${reply:0:300}"
for i in 1 2 3 4; do
  wait "${streams[i - 1]}" 2>/dev/null || true
  ends=$(grep -o '"finish_reason":"[a-z]*"\|"error":{[^}]*}' "$work/stream.$i" | tail -n 1)
  report "stream $i: $(grep -c '^data: {' "$work/stream.$i") events, ends with ${ends:-nothing}" \
    "$(grep -q '^data: \[DONE\]' "$work/stream.$i" && echo '[DONE]' || echo '(no [DONE])')"
done
report "mpirun and coordinator lines after the loss (ORTE, lost, exiting):"
grep -E 'ORTE|orted|lost|daemon|exiting|abort|error' "$work/cluster.log" | grep -v 'KV cache' |
  head -n 20 | sed 's/^/    /'
if kill -0 "$cluster" 2>/dev/null; then
  report "the launcher still runs; SIGTERM to it:"
  kill -TERM "$cluster"
  for _ in $(seq 1 300); do kill -0 "$cluster" 2>/dev/null || break; sleep 0.1; done
  code=0
  kill -0 "$cluster" 2>/dev/null && code=still-running || wait "$cluster" || code=$?
  report "    launcher: exit $code; $(grep -c 'exiting with code 0' "$work/cluster.log") ranks logged exit 0"
  if [ "$(alive "$mpirun_pid")" = alive ]; then
    report "    mpirun still runs; SIGTERM to mpirun itself:"
    kill -TERM "$mpirun_pid"
    for _ in $(seq 1 150); do kill -0 "$mpirun_pid" 2>/dev/null || break; sleep 0.1; done
    report "    mpirun 15 s later: $(alive "$mpirun_pid"); launcher: $(alive "$cluster")"
  fi
else
  code=0
  wait "$cluster" || code=$?
  report "the launcher had exited with code $code"
fi
cluster=""
report "the log's last lines:"
tail -n 12 "$work/cluster.log" | cut -c1-240 | sed 's/^/    /'
say "lost at $lost_at"
