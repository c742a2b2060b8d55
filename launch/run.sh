#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, start a local disaggregated
# Duet cluster with the default model (mpirun: the coordinator on rank 0, one
# prefill instance on rank 1, one decode instance on rank 2, all on
# loopback), answer a prompt through it with duet-client (streamed to stdout;
# TTFT, TPOT and the other timings on stderr), and stop the cluster.
# Usage: launch/run.sh ["prompt text"]
#   env DUET_THREADS=1  compute threads per instance rank
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
prompt=${1:-"Write one sentence about the sea."}
threads=${DUET_THREADS:-1}
"$root/launch/setup.sh"
"$root/launch/build.sh"

model=${DUET_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf
bin=${DUET_BUILD_DIR:-$root/build}/tools
work=$(mktemp -d)
cluster=""
stop_cluster() {
  [ -n "$cluster" ] && kill -0 "$cluster" 2>/dev/null || return 0
  # SIGTERM to the coordinator (rank 0) ends every rank in order; mpirun follows.
  local rank0
  rank0=$(pgrep -P "$cluster" -f "duet serve" | head -n 1 || true)
  kill -TERM "${rank0:-$cluster}" 2>/dev/null || true
  wait "$cluster" 2>/dev/null || true
}
cleanup() {
  stop_cluster
  rm -rf "$work"
}
trap cleanup EXIT

# Ports 0: the coordinator picks free ones and prints them on stdout.
mpirun --allow-run-as-root --oversubscribe -np 3 \
  "$bin/duet" serve --model "$model" --prefill 1 --decode 1 --threads "$threads" \
  --rpc-port 0 --http-port 0 >"$work/ports" 2>"$work/log" &
cluster=$!
for _ in $(seq 1 600); do
  grep -q '^http listening' "$work/ports" 2>/dev/null && break
  kill -0 "$cluster" 2>/dev/null || { cat "$work/log" >&2; echo "run: the cluster did not start" >&2; exit 1; }
  sleep 0.1
done
rpc=$(sed -n 's/^rpc listening on //p' "$work/ports")
http=$(sed -n 's/^http listening on //p' "$work/ports")
[ -n "$rpc" ] || { cat "$work/log" >&2; echo "run: the cluster did not start" >&2; exit 1; }
echo "run: disaggregated cluster (1 prefill + 1 decode instance) on rpc $rpc," \
  "http http://$http (OpenAI-compatible)" >&2
"$bin/duet-client" --connect "$rpc" generate --chat --prompt "$prompt" -n 64
