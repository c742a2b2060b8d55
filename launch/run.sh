#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, and answer a prompt with the
# default model. Usage: launch/run.sh ["prompt text"]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
prompt=${1:-"Write one sentence about the sea."}
"$root/launch/setup.sh"
"$root/launch/build.sh"
exec "$root/build/tools/duet" generate --model "${DUET_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf" \
  --chat --prompt "$prompt" -n 64
