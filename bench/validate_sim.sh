#!/usr/bin/env bash
# The cluster simulator against real clusters on this machine, figure by
# figure. For each layout of LAYOUTS: a profile of the model is measured
# (`duet profile` under mpirun -np 2: steps on one thread, KV transfers, the
# all-reduce), right before the real runs, because a shared VM's speed drifts
# by tens of percent over minutes; the layout is started for real with mpirun
# (coordinator + instance ranks, one compute thread each) and driven twice by
# duet-bench with the same trace (two prompt seeds: the same lengths and
# arrivals, fresh prompt text, so nothing hits the prefix cache); and the
# same trace goes through duet-sim with that profile, the cluster's layout,
# and the host's core count. For
# TTFT and TPOT p50/p99, output throughput and goodput it prints the two
# real figures, their spread (|a - b| / mean), the simulated figure and its
# error against the real mean, and whether the error is within
# max(10%, spread); then the median error.
#
# Usage: bench/validate_sim.sh [MODEL]
#   env LAYOUTS="2C 1P+1D 1P+2D 2P+1D"
#       TRACE=bench/traces/chat_80.csv  N=40  RATE=   (empty: the trace's own times)
#       SLO=ttft=2000,tpot=150          goodput's bounds, ms
#       BUDGET=40                       seconds of step measurement per profile
#       PROFILE=                        one existing profile for every layout instead
#       SIM_ONLY=1                      simulate again against OUT's real runs and
#                                       profiles, measuring nothing (a simulator change)
#       OUT=.cache/validate_sim  DUET_BUILD_DIR=build
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
layouts=${LAYOUTS:-2C 1P+1D 1P+2D 2P+1D}
trace=${TRACE:-$root/bench/traces/chat_80.csv}
n=${N:-40}
rate=${RATE:-}
slo=${SLO:-ttft=2000,tpot=150}
budget=${BUDGET:-40}
out=${OUT:-$root/.cache/validate_sim}
build=${DUET_BUILD_DIR:-$root/build}
duet=$build/tools/duet
bench=$build/bench/duet-bench
sim=$build/sim/duet-sim
sim_only=${SIM_ONLY:-0}
mpirun=(mpirun --allow-run-as-root --oversubscribe)

for tool in "$duet" "$bench" "$sim"; do
  [[ -x "$tool" ]] || { echo "build duet, duet-bench and duet-sim in $build first" >&2; exit 1; }
done
[[ -f "$model" ]] || { echo "no model at $model" >&2; exit 1; }
mkdir -p "$out"
start=$(date +%s)
cores=$(nproc)
rate_args=()
[[ -n "$rate" ]] && rate_args=(--rate "$rate")

measure_profile() {
  echo "[validate_sim] $1: measuring a profile (${budget}s of steps, then transfers)" >&2
  # Unbound: the neighbour measurement runs a second instance on the other core.
  "${mpirun[@]}" --bind-to none -np 2 "$duet" profile --model "$model" --threads 1 \
    --budget "$budget" --out "$2" 2>"${2%.json}.log"
}

# "2C" -> colocated flags; "1P+2D" -> disaggregated flags; and the world size.
serve_args() {
  case "$1" in
    *C) echo "--mode colocated" ;;  # as many instances as the ranks after the coordinator
    *P+*D) local p=${1%%P+*} d=${1#*+}; echo "--prefill $p --decode ${d%D}" ;;
    *) echo "unknown layout $1" >&2; exit 1 ;;
  esac
}
world_size() {
  case "$1" in
    *C) echo $((1 + ${1%C})) ;;
    *P+*D) local p=${1%%P+*} d=${1#*+}; echo $((1 + p + ${d%D})) ;;
  esac
}

# shellcheck source=launch/cluster_lib.sh
. "$root/launch/cluster_lib.sh"
mpirun_pid=
trap 'serve_stop "$mpirun_pid"' EXIT

# Starts LAYOUT for real and drives it twice with the trace.
real_runs() {
  local layout=$1 name=$2 log=$3 rpc run
  # shellcheck disable=SC2046
  "${mpirun[@]}" -np "$(world_size "$layout")" "$duet" serve --model "$model" --threads 1 \
    --rpc-port 0 --http-port 0 $(serve_args "$layout") >"$out/$name.ports" 2>"$log" &
  mpirun_pid=$!
  serve_wait_ready "$out/$name.ports" "$mpirun_pid" "$log"
  rpc=$(sed -n 's/^rpc listening on //p' "$out/$name.ports")
  for run in 1 2; do
    echo "[validate_sim] $layout: real run $run ($n requests)" >&2
    "$bench" --connect "$rpc" --trace "$trace" "${rate_args[@]}" -n "$n" --seed "$run" \
      --slo "$slo" --warmup 2 --no-progress --json "$out/${name}_real$run.json" \
      >"$out/${name}_real$run.txt"
  done
  serve_stop "$mpirun_pid"
  mpirun_pid=
}

for layout in $layouts; do
  name=${layout//+/_}
  log=$out/$name.log
  profile=${PROFILE:-$out/${name}_profile.json}
  if [[ $sim_only == 1 ]]; then
    for f in "$profile" "$out/${name}_real1.json" "$out/${name}_real2.json"; do
      [[ -f "$f" ]] || { echo "SIM_ONLY: no $f from an earlier run" >&2; exit 1; }
    done
  fi
  [[ -n "${PROFILE:-}" || $sim_only == 1 ]] || measure_profile "$layout" "$profile"
  [[ $sim_only == 1 ]] || real_runs "$layout" "$name" "$log"
  transfer=()
  [[ $layout == *P+*D ]] && transfer=(--transfer mpi-shm)
  "$sim" --profile "$profile" --cluster "$layout" --host-cores "$cores" "${transfer[@]}" \
    --trace "$trace" "${rate_args[@]}" -n "$n" --slo "$slo" --json "$out/${name}_sim.json" \
    >"$out/${name}_sim.txt"
  "$sim" --profile "$profile" --cluster "$layout" --host-cores "$cores" "${transfer[@]}" \
    --neighbour-slowdown 1 --trace "$trace" "${rate_args[@]}" -n "$n" --slo "$slo" \
    --json "$out/${name}_sim_plain.json" >"$out/${name}_sim_plain.txt"
done

python3 - "$out" "$profile" "$slo" "$trace" "$n" "$(( $(date +%s) - start ))" $layouts <<'PY'
import json, pathlib, statistics, sys
out, profile_path, slo, trace, n, seconds = pathlib.Path(sys.argv[1]), *sys.argv[2:7]
layouts = sys.argv[7:]
profile = json.loads(pathlib.Path(profile_path).read_text())  # the last layout's
figures = [("TTFT p50 ms", lambda s: s["ttft_ms"]["p50"]), ("TTFT p99 ms", lambda s: s["ttft_ms"]["p99"]),
           ("TPOT p50 ms", lambda s: s["tpot_ms"]["p50"]), ("TPOT p99 ms", lambda s: s["tpot_ms"]["p99"]),
           ("output tok/s", lambda s: s["output_token_rate"]), ("goodput req/s", lambda s: s["goodput"])]
def summary(name):
    return json.loads((out / name).read_text())["runs"][0]["summary"]
print(f"profile: {profile['device']}; trace {pathlib.Path(trace).name} (first {n} requests); "
      f"SLO {slo} ms; one compute thread per instance rank")
for layout in layouts:
    path = out / f"{layout.replace('+', '_')}_profile.json"
    if path.exists():
        p = json.loads(path.read_text())
        q = p["instances"][0]["quality"]
        host = p.get("host", {}).get("neighbour_slowdown", 1.0)
        print(f"- {layout}: its profile's step fit, relative error median "
              f"{q['median_rel_error'] * 100:.1f}%, p90 {q['p90_rel_error'] * 100:.1f}% "
              f"({q['n_samples']} steps); a step beside another instance {host:.3f}x")
print()
print("| layout | figure | real 1 | real 2 | spread | sim | error | within max(10%, spread) "
      "| sim without the slowdown | its error |")
print("|---|---|---:|---:|---:|---:|---:|---|---:|---:|")
errors, plain_errors, misses = [], [], []
for layout in layouts:
    name = layout.replace("+", "_")
    a, b, s = summary(f"{name}_real1.json"), summary(f"{name}_real2.json"), summary(f"{name}_sim.json")
    plain = summary(f"{name}_sim_plain.json")
    for label, get in figures:
        x, y, z, w = get(a), get(b), get(s), get(plain)
        mean = (x + y) / 2
        spread = abs(x - y) / mean if mean else 0.0
        error = abs(z - mean) / mean if mean else 0.0
        plain_error = abs(w - mean) / mean if mean else 0.0
        ok = error <= max(0.10, spread)
        errors.append(error)
        plain_errors.append(plain_error)
        if not ok:
            misses.append(f"{layout} {label}")
        print(f"| {layout} | {label} | {x:.1f} | {y:.1f} | {spread * 100:.1f}% | {z:.1f} | "
              f"{error * 100:.1f}% | {'yes' if ok else 'no'} | {w:.1f} | {plain_error * 100:.1f}% |")
print(f"\nmedian error {statistics.median(errors) * 100:.1f}% over {len(errors)} figures "
      f"({statistics.median(plain_errors) * 100:.1f}% without the neighbour slowdown); "
      f"{len(errors) - len(misses)} within max(10%, spread)"
      + (f"; off: {', '.join(misses)}" if misses else "") + f"; {seconds} s in all")
PY
