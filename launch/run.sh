#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, start a Duet server with the
# default model on loopback, answer a prompt through it with duet-client
# (streamed to stdout, timings on stderr), and stop the server.
# Usage: launch/run.sh ["prompt text"]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
prompt=${1:-"Write one sentence about the sea."}
"$root/launch/setup.sh"
"$root/launch/build.sh"

model=${DUET_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf
bin=${DUET_BUILD_DIR:-$root/build}/tools
work=$(mktemp -d)
server=""
cleanup() {
  if [ -n "$server" ]; then kill -TERM "$server" 2>/dev/null && wait "$server" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# Ports 0: the server picks free ones and prints them on stdout.
"$bin/duet" serve --model "$model" --rpc-port 0 --http-port 0 >"$work/ports" 2>"$work/log" &
server=$!
for _ in $(seq 1 300); do
  grep -q '^http listening' "$work/ports" 2>/dev/null && break
  kill -0 "$server" 2>/dev/null || { cat "$work/log" >&2; echo "run: the server did not start" >&2; exit 1; }
  sleep 0.1
done
rpc=$(sed -n 's/^rpc listening on //p' "$work/ports")
http=$(sed -n 's/^http listening on //p' "$work/ports")
echo "run: serving on rpc $rpc, http http://$http (OpenAI-compatible)" >&2
"$bin/duet-client" --connect "$rpc" generate --chat --prompt "$prompt" -n 64
