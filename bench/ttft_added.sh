#!/usr/bin/env bash
# The TTFT that disaggregation adds: the same prompts, one at a time, through
# the single-process `duet serve` and through a disaggregated cluster
# (mpirun: coordinator, 1 prefill instance, 1 decode instance), each instance
# with the same compute threads. Alternates the two ROUNDS times and prints
# the median TTFT and TPOT of each and the difference.
#
# Usage: bench/ttft_added.sh [MODEL]
#   env TOKENS=512  prompt tokens     N=12  requests per round (+2 warm-up)
#       ROUNDS=3    THREADS=1         OUT=.cache/ttft_added  DUET_BUILD_DIR=build
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
tokens=${TOKENS:-512}
n=${N:-12}
rounds=${ROUNDS:-3}
threads=${THREADS:-1}
out=${OUT:-$root/.cache/ttft_added}
build=${DUET_BUILD_DIR:-$root/build}
duet=$build/tools/duet
bench=$build/bench/duet-bench
[[ -x "$duet" && -x "$bench" ]] || { echo "build duet and duet-bench in $build first" >&2; exit 1; }
mkdir -p "$out"

# shellcheck source=launch/cluster_lib.sh
. "$root/launch/cluster_lib.sh"
pid=
trap 'serve_stop "$pid"' EXIT

# measure NAME ROUND COMMAND...: starts the server, one request at a time.
measure() {
  local name=$1 round=$2
  shift 2
  "$@" --model "$model" --threads "$threads" --rpc-port 0 --http-port 0 \
    >"$out/$name.ports" 2>"$out/$name.log" &
  pid=$!
  serve_wait_ready "$out/$name.ports" "$pid" "$out/$name.log"
  "$bench" --connect "$(sed -n 's/^rpc listening on //p' "$out/$name.ports")" --concurrency 1 \
    -n "$n" --input-len "$tokens" --output-len 8 --seed "$round" --warmup 2 --no-progress \
    --json "$out/$name-$round.json" >/dev/null
  serve_stop "$pid"
  pid=
}

for round in $(seq "$rounds"); do
  measure single "$round" "$duet" serve
  measure disaggregated "$round" mpirun --allow-run-as-root --oversubscribe -np 3 "$duet" serve \
    --prefill 1 --decode 1
done

python3 - "$out" "$rounds" "$tokens" "$threads" <<'PY'
import json, pathlib, statistics, sys
out, rounds, tokens, threads = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
def med(name, key):
    runs = [json.loads((out / f"{name}-{r}.json").read_text())["runs"][0]["summary"]
            for r in range(1, rounds + 1)]
    return statistics.median(s[key]["p50"] for s in runs)
single, disagg = med("single", "ttft_ms"), med("disaggregated", "ttft_ms")
print(f"{tokens}-token prompts, one at a time, {threads} thread(s) per instance; "
      f"median over {rounds} rounds of each round's p50\n")
print("| server | TTFT ms | TPOT ms |\n|---|---:|---:|")
print(f"| single process | {single:.1f} | {med('single', 'tpot_ms'):.2f} |")
print(f"| disaggregated 1P+1D | {disagg:.1f} | {med('disaggregated', 'tpot_ms'):.2f} |")
print(f"\nadded by disaggregation: {disagg - single:+.1f} ms TTFT")
PY
