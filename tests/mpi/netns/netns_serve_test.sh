#!/usr/bin/env bash
# A Duet cluster across three hosts, on one machine: every host is a network
# namespace with a host name of its own, joined to the others by a veth pair
# on a bridge (10.77.0.0/24). launch/hostfile.sh starts the cluster from host
# a, and mpirun reaches hosts b and c through netns_agent.sh instead of ssh:
#
#   host a, 10.77.0.1: mpirun, rank 0 (the coordinator, HTTP on 10.77.0.1)
#   host b, 10.77.0.2: rank 1 (the prefill instance)
#   host c, 10.77.0.3: rank 2 (the decode instance)
#
# MPI may only use TCP on that subnet (btl tcp,self; oob and btl restricted
# to it), and the test checks:
# - greedy completions over HTTP equal the single-process `duet serve`'s;
# - bytes really crossed the veths of hosts b and c while they were answered
#   (disaggregated: host c received at least the prompts' KV cache, over
#   Duet's own TCP connections: --kv-transport auto picks tcp across hosts);
# - the coordinator's control messages go over Duet's own TCP connections
#   too (--control-transport auto picks tcp across hosts);
# - SIGTERM to the launcher ends every rank with exit 0, and no process is
#   left in any namespace;
# and always removes the namespaces (also those a killed run left behind).
# The namespaces are netns_lib.sh's.
#
# Usage: netns_serve_test.sh [duet serve arguments...]   (e.g. --mode colocated)
# Environment: DUET_BINARY (default build/tools/duet, or DUET_BUILD_DIR's),
# DUET_MODEL (default: the model launch/setup.sh fetches), DUET_MPIRUN
# (default mpirun).
# Exit codes: 0 passed; 77 skipped (not root, or namespaces not permitted);
# anything else failed.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../.." && pwd)
duet=${DUET_BINARY:-${DUET_BUILD_DIR:-$root/build}/tools/duet}
model=${DUET_MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
engine_args=(--kv-cache-mem 256MiB)
prompts=("The capital of France is" "Once upon a time, in a quiet village,")
max_tokens=24

say() { printf 'netns-test: %s\n' "$*" >&2; }
skip() { say "SKIP: $*"; exit 77; }
fail() { say "FAIL: $*"; exit 1; }

# shellcheck source=SCRIPTDIR/netns_lib.sh
. "$here/netns_lib.sh"
netns_log() { say "$*"; }  # the library's messages as this test's

netns_preflight || { [ $? -ne 77 ] || skip "$NETNS_ERROR"; fail "$NETNS_ERROR"; }
[ -x "$duet" ] || fail "no duet binary at $duet (DUET_BINARY)"
[ -f "$model" ] || fail "no model at $model (DUET_MODEL; launch/setup.sh fetches it)"

mode=disaggregated  # duet serve's default
previous=""
for arg in "$@"; do
  case $arg in --mode=*) mode=${arg#--mode=} ;; esac
  [ "$previous" != --mode ] || mode=$arg
  previous=$arg
done

work=$(mktemp -d)
cluster=""
reference=""

# shellcheck disable=SC2317 # called from the trap
cleanup() {
  local code=$?
  if [ -n "$cluster" ] && kill -0 "$cluster" 2>/dev/null; then
    kill -TERM "$cluster" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$cluster" 2>/dev/null || break; sleep 0.1; done
  fi
  if [ -n "$reference" ] && kill -0 "$reference" 2>/dev/null; then
    kill -TERM "$reference" 2>/dev/null || true
    wait "$reference" 2>/dev/null || true
  fi
  netns_down
  if [ "$code" -ne 0 ] && [ "$code" -ne 77 ] && [ -s "$work/cluster.log" ]; then
    say "the cluster's log (last 60 lines):"
    tail -n 60 "$work/cluster.log" >&2
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'say "FAIL: line $LINENO: $BASH_COMMAND"' ERR
trap 'exit 143' TERM
trap 'exit 130' INT

# --- the network: hosts a, b, c (10.77.0.1-3) on a bridge; removes what
# killed runs left behind first ---
netns_up "duetnet$$" || { [ $? -ne 77 ] || skip "$NETNS_ERROR"; fail "cannot set up the network namespaces"; }
netns_hostfile "$work/hosts"
ns_a=$(netns_namespace a)

# Waits until file $1 has the `http listening on` line; $2: the process.
await_listening() {
  local deadline=$((SECONDS + 180))
  until grep -qs '^http listening on ' "$1"; do
    kill -0 "$2" 2>/dev/null || return 1
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}

# One greedy completion: $1 the server's base URL, $2 the prompt, $3 the
# namespace to send it from (default: this one); the reply (JSON) on stdout.
complete() {
  local body run=()
  [ -z "${3:-}" ] || run=(ip netns exec "$3")
  body=$(python3 -c 'import json, sys
print(json.dumps({"prompt": sys.argv[1], "max_tokens": int(sys.argv[2]), "temperature": 0,
                  "ignore_eos": True}))' "$2" "$max_tokens")
  "${run[@]}" curl -sS --fail-with-body --max-time 120 -H 'Content-Type: application/json' -d "$body" \
    "$1/v1/completions"
}
json_field() {  # $1: a Python expression on `r`, the JSON on stdin
  python3 -c 'import json, sys; r = json.load(sys.stdin); print(eval(sys.argv[1]))' "$1"
}

# --- the reference: the single-process server, on loopback ---
started=$SECONDS
"$duet" serve --model "$model" --rpc-port 0 --http-port 0 --threads 1 "${engine_args[@]}" \
  >"$work/reference.out" 2>"$work/reference.log" &
reference=$!
await_listening "$work/reference.out" "$reference" || {
  cat "$work/reference.log" >&2
  fail "the single-process server did not start"
}
reference_url=http://$(sed -n 's/^http listening on //p' "$work/reference.out")
expected=()
for prompt in "${prompts[@]}"; do
  reply=$(complete "$reference_url" "$prompt") || fail "the single process refused \"$prompt\": $reply"
  expected+=("$(json_field 'json.dumps(r["choices"][0]["text"])' <<<"$reply")")
done
kill -TERM "$reference"
code=0
wait "$reference" || code=$?
reference=""
[ "$code" -eq 0 ] || fail "the single-process server exited with code $code"

# --- the cluster, launched from host a (under host a's name) ---
netns_start_cluster "$duet" "$model" "$work/hosts" "$work/cluster.out" "$work/cluster.log" \
  1 1 "${engine_args[@]}" "$@"
cluster=$NETNS_CLUSTER
await_listening "$work/cluster.out" "$cluster" || fail "the cluster did not start"
cluster_url=http://$(sed -n 's/^http listening on //p' "$work/cluster.out")
say "cluster ($mode) listening on $cluster_url after $((SECONDS - started)) s"
transport=tcp  # across hosts, unless the arguments force mpi
[[ " $* " != *" --kv-transport mpi "* ]] || transport=mpi
if [ "$mode" = disaggregated ]; then
  grep -q "kv transfer: between instances over $transport (" "$work/cluster.log" ||
    fail "the cluster's ranks span 3 hosts, yet its KV does not go over $transport"
fi
control=tcp  # across hosts, unless the arguments force mpi
[[ " $* " != *" --control-transport mpi "* ]] || control=mpi
grep -q "control channel: coordinator to ranks over $control (" "$work/cluster.log" ||
  fail "the cluster's ranks span 3 hosts, yet its control messages do not go over $control"

bytes_b=$(netns_veth_bytes b)
bytes_c=$(netns_veth_bytes c)
rx_c=$(netns_veth_bytes c rx)
prompt_tokens=0
for i in "${!prompts[@]}"; do
  reply=$(complete "$cluster_url" "${prompts[i]}" "$ns_a") ||
    fail "the cluster refused \"${prompts[i]}\": $reply"
  got=$(json_field 'json.dumps(r["choices"][0]["text"])' <<<"$reply")
  [ "$got" = "${expected[i]}" ] ||
    fail "prompt \"${prompts[i]}\": the cluster answered $got, the single process ${expected[i]}"
  say "prompt \"${prompts[i]}\": $got (as the single process)"
  prompt_tokens=$((prompt_tokens + $(json_field 'r["usage"]["prompt_tokens"]' <<<"$reply")))
done
crossed_b=$(($(netns_veth_bytes b) - bytes_b))
crossed_c=$(($(netns_veth_bytes c) - bytes_c))
received_c=$(($(netns_veth_bytes c rx) - rx_c))
say "bytes through the veths while answering: host b $crossed_b, host c $crossed_c"
# Requests out and tokens back: well over 1 KiB, where a quiet link carries
# a few ARP packets.
[ $((crossed_b + crossed_c)) -ge 1024 ] || fail "hardly a byte crossed hosts b and c: MPI did not use the network"
if [ "$mode" = disaggregated ]; then
  # The KV of every prompt token but (perhaps) the last, which the decode
  # instance may compute itself.
  per_token=$(sed -n 's/.*KV cache: \([0-9]*\) bytes per token.*/\1/p' "$work/cluster.log" | head -n 1)
  [ -n "$per_token" ] || fail "the log does not say the KV cache's bytes per token"
  kv=$(((prompt_tokens - ${#prompts[@]}) * per_token))
  say "host c (decode) received $received_c bytes; the prompts' KV cache is at least $kv bytes"
  [ "$received_c" -ge "$kv" ] || fail "the decode host received less than the prompts' KV cache"
fi

# --- stop: SIGTERM to the launcher, which passes it to the coordinator ---
kill -TERM "$cluster"
for _ in $(seq 1 300); do kill -0 "$cluster" 2>/dev/null || break; sleep 0.1; done
kill -0 "$cluster" 2>/dev/null && fail "the cluster did not stop within 30 s of SIGTERM"
code=0
wait "$cluster" || code=$?
cluster=""
[ "$code" -eq 0 ] || fail "the cluster exited with code $code"
for rank in 0 1 2; do
  grep -q "rank $rank: exiting with code 0" "$work/cluster.log" || fail "rank $rank did not exit with 0"
done
if [ "$mode" = disaggregated ]; then
  # The decode rank's own count of the KV its transfer received.
  transferred=$(sed -n 's/.*(rank 2): kv transfer: .* sent, [0-9]* (\([0-9]*\) bytes) received.*/\1/p' \
    "$work/cluster.log" | head -n 1)
  say "the decode rank's KV transfer received ${transferred:-no} bytes"
  [ "${transferred:-0}" -ge "$kv" ] || fail "the decode rank's KV transfer received less than the prompts' KV cache"
fi
for ns in "${NETNS_NAMESPACES[@]}"; do
  left=$(ip netns pids "$ns")
  [ -z "$left" ] || fail "processes left in $ns: $(echo "$left" | tr '\n' ' ')"
done
say "PASS in $((SECONDS - started)) s"
