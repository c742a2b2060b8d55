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
# Set-up and build progress go to stderr: stdout carries the answer alone,
# so that answer=$(launch/run.sh "...") captures just the text.
"$root/launch/setup.sh" >&2
"$root/launch/build.sh" >&2

model=${DUET_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf
bin=${DUET_BUILD_DIR:-$root/build}/tools
work=$(mktemp -d)
cluster=""
# shellcheck source=launch/cluster_lib.sh
. "$root/launch/cluster_lib.sh"
cleanup() {
  serve_stop "$cluster"
  rm -rf "$work"
}
trap cleanup EXIT

# Ports 0: the coordinator picks free ones and prints them on stdout.
# odls_base_sigkill_timeout: should mpirun itself be signalled, the ranks get
# SIGTERM 40 s later and SIGKILL 40 s after that: time for the coordinator's
# drain (--drain-timeout, 30 s) and shutdown (README: stopping a cluster).
mpirun --allow-run-as-root --oversubscribe --enable-recovery \
  --mca odls_base_sigkill_timeout 40 -np 3 \
  "$bin/duet" serve --model "$model" --prefill 1 --decode 1 --threads "$threads" \
  --rpc-port 0 --http-port 0 >"$work/ports" 2>"$work/log" &
cluster=$!
serve_wait_ready "$work/ports" "$cluster" "$work/log" || { echo "run: the cluster did not start" >&2; exit 1; }
rpc=$(sed -n 's/^rpc listening on //p' "$work/ports")
http=$(sed -n 's/^http listening on //p' "$work/ports")
echo "run: disaggregated cluster (1 prefill + 1 decode instance) on rpc $rpc," \
  "http http://$http (OpenAI-compatible)" >&2
"$bin/duet-client" --connect "$rpc" generate --chat --prompt "$prompt" -n 64
