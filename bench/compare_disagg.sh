#!/usr/bin/env bash
# Disaggregated against colocated serving on the same ranks and threads, under
# a mixed workload: long prompts (1500-3500 tokens) arriving among many chat
# streams (bench/traces/example_mixed.csv: 80% chat, 20% long, bursty
# arrivals). Each layout is started alone with mpirun (coordinator + 3
# instance ranks, one compute thread each), driven by `duet-bench` over
# Cap'n Proto at each rate of RATES (the trace's arrivals scaled to the rate,
# the same requests for every layout), and stopped:
#   colocated  3 instances that each prefill and decode (the baseline)
#   1P+2D      1 prefill instance, 2 decode instances
#   2P+1D      2 prefill instances, 1 decode instance
# The claim under test: in colocated serving a long prefill stalls the
# decode steps batched with it (TPOT and inter-token spikes); disaggregated,
# decode instances never run a prefill. Prints a markdown table per rate:
# TTFT and TPOT p50/p99, inter-token latency p99 and max, throughput and
# goodput under SLO.
#
# Usage: bench/compare_disagg.sh [MODEL]
#   env RATES=0.5,1   request rates, req/s
#       N=60          requests per rate (the trace's first N)
#       LAYOUTS="colocated 1P+2D 2P+1D"
#       THREADS=1     compute threads per instance rank
#       SLO=ttft=3000,tpot=150   goodput's bounds, ms
#       TRACE=bench/traces/example_mixed.csv  SEED=0
#       OUT=.cache/compare_disagg  DUET_BUILD_DIR=build
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
rates=${RATES:-0.5,1}
n=${N:-60}
layouts=${LAYOUTS:-colocated 1P+2D 2P+1D}
threads=${THREADS:-1}
slo=${SLO:-ttft=3000,tpot=150}
trace=${TRACE:-$root/bench/traces/example_mixed.csv}
seed=${SEED:-0}
out=${OUT:-$root/.cache/compare_disagg}
build=${DUET_BUILD_DIR:-$root/build}
duet=$build/tools/duet
bench=$build/bench/duet-bench

[[ -x "$duet" && -x "$bench" ]] || { echo "build duet and duet-bench in $build first" >&2; exit 1; }
[[ -f "$model" ]] || { echo "no model at $model" >&2; exit 1; }
mkdir -p "$out"

cluster_args() {
  case "$1" in
    colocated) echo "--mode colocated --prefill 1 --decode 2" ;;
    *P+*D) local p=${1%%P+*} d=${1#*+}; echo "--prefill $p --decode ${d%D}" ;;
    *) echo "unknown layout $1" >&2; exit 1 ;;
  esac
}

# shellcheck source=launch/cluster_lib.sh
. "$root/launch/cluster_lib.sh"
mpirun_pid=
trap 'serve_stop "$mpirun_pid"' EXIT

for layout in $layouts; do
  name=${layout//+/_}
  log=$out/$name.log
  # shellcheck disable=SC2046
  mpirun --allow-run-as-root --oversubscribe -np 4 "$duet" serve --model "$model" \
    --threads "$threads" --rpc-port 0 --http-port 0 $(cluster_args "$layout") \
    >"$out/$name.ports" 2>"$log" &
  mpirun_pid=$!
  serve_wait_ready "$out/$name.ports" "$mpirun_pid" "$log"
  rpc=$(sed -n 's/^rpc listening on //p' "$out/$name.ports")
  echo "[compare_disagg] $layout: rates $rates, $n requests each" >&2
  "$bench" --connect "$rpc" --trace "$trace" --rate "$rates" -n "$n" --seed "$seed" \
    --slo "$slo" --warmup 3 --no-progress --json "$out/$name.json" >"$out/$name.txt"
  serve_stop "$mpirun_pid"
  mpirun_pid=
done

python3 - "$out" "$model" "$threads" "$slo" "$trace" $layouts <<'PY'
import json, pathlib, sys
out, model, threads, slo, trace = pathlib.Path(sys.argv[1]), *sys.argv[2:6]
layouts = sys.argv[6:]
reports = {l: json.loads((out / f"{l.replace('+', '_')}.json").read_text()) for l in layouts}
first = reports[layouts[0]]
print(f"model: {pathlib.Path(model).name}; 4 ranks (coordinator + 3 instances), {threads} "
      f"compute thread(s) each; trace {pathlib.Path(trace).name} (first "
      f"{first['config']['num_requests']} requests) scaled to each rate; SLO {slo} ms\n")
print("| rate req/s | layout | ok | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p99 | ITL max "
      "| out tok/s | goodput req/s |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for i, run in enumerate(first["runs"]):
    for layout, report in reports.items():
        s = report["runs"][i]["summary"]
        print(f"| {run['rate']} | {layout} | {s['n_ok']}/{s['n_requests']} | "
              f"{s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p99']:.0f} | "
              f"{s['tpot_ms']['p50']:.1f} | {s['tpot_ms']['p99']:.1f} | "
              f"{s['itl_ms']['p99']:.1f} | {s['itl_ms']['max']:.0f} | "
              f"{s['output_token_rate']:.1f} | {s['goodput']:.2f} |")
print(f"\n(latencies in ms; per-request JSON in {out})")
PY
