#!/usr/bin/env bash
# Online rebalancing on a shifting load, for real and simulated. The trace
# (duet-bench make-trace --phases) goes chat -> pages to read -> chat; it is
# sent by duet-bench to a disaggregated cluster started with mpirun (one
# compute thread per rank) in each of these configurations, which alternate
# round by round:
#   - the first of LAYOUTS with `--rebalance auto --slo SLO` (the rebalancer
#     moves instances between prefill and decode as the load shifts);
#   - every layout of LAYOUTS fixed.
# The same trace then goes through duet-sim with a profile measured on this
# machine (the same rule, in simulated time: sim/simulator.h). It prints, per
# configuration, the goodput under the SLO of every round, their median, the
# simulated figure, and the role changes each made.
#
# Usage: bench/rebalance_shift.sh [MODEL]
#   env PHASES=chat:60:0.75,pages:90:0.4,chat:60:0.75   the trace's phases (seed 1)
#       TRACE=                          a trace file instead of PHASES
#       SLO=ttft=4000,tpot=30           the rebalancer's targets and goodput's bounds, ms
#       LAYOUTS="1P+2D 2P+1D"           fixed layouts (the first also starts the rebalanced run)
#       ROUNDS=3  BUDGET=40             rounds; seconds of step measurement for the profile
#       PROFILE=                        an existing profile instead of measuring one
#       OUT=.cache/rebalance_shift  DUET_BUILD_DIR=build
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
phases=${PHASES:-chat:60:0.75,pages:90:0.4,chat:60:0.75}
slo=${SLO:-ttft=4000,tpot=30}
layouts=${LAYOUTS:-1P+2D 2P+1D}
rounds=${ROUNDS:-3}
budget=${BUDGET:-40}
out=${OUT:-$root/.cache/rebalance_shift}
build=${DUET_BUILD_DIR:-$root/build}
duet=$build/tools/duet
bench=$build/bench/duet-bench
sim=$build/sim/duet-sim
mpirun=(mpirun --allow-run-as-root --oversubscribe)

for tool in "$duet" "$bench" "$sim"; do
  [[ -x "$tool" ]] || { echo "build duet, duet-bench and duet-sim in $build first" >&2; exit 1; }
done
[[ -f "$model" ]] || { echo "no model at $model" >&2; exit 1; }
mkdir -p "$out"
start=$(date +%s)

trace=${TRACE:-$out/shift.csv}
[[ -n "${TRACE:-}" ]] || "$bench" make-trace --phases "$phases" --seed 1 -o "$trace"
profile=${PROFILE:-$out/profile.json}
if [[ -z "${PROFILE:-}" ]]; then
  echo "[rebalance_shift] measuring a profile (${budget}s of steps, then transfers)" >&2
  "${mpirun[@]}" --bind-to none -np 2 "$duet" profile --model "$model" --threads 1 \
    --budget "$budget" --out "$profile" 2>"$out/profile.log"
fi

# shellcheck source=launch/cluster_lib.sh
. "$root/launch/cluster_lib.sh"
mpirun_pid=
trap 'serve_stop "$mpirun_pid"' EXIT

# "1P+2D" -> "1 2"
counts() { local p=${1%%P+*} d=${1#*+}; echo "$p ${d%D}"; }

# config: "auto" (the first layout, rebalanced) or a layout.
real_run() {
  local config=$1 round=$2 layout=$1 extra=() name p d rpc
  if [[ $config == auto ]]; then
    layout=${layouts%% *}
    extra=(--rebalance auto --slo "$slo")
  fi
  read -r p d <<<"$(counts "$layout")"
  name=${config//+/_}_r$round
  echo "[rebalance_shift] round $round: $config" >&2
  "${mpirun[@]}" -np $((1 + p + d)) "$duet" serve --model "$model" --threads 1 \
    --rpc-port 0 --http-port 0 --prefill "$p" --decode "$d" "${extra[@]}" \
    >"$out/$name.ports" 2>"$out/$name.log" &
  mpirun_pid=$!
  serve_wait_ready "$out/$name.ports" "$mpirun_pid" "$out/$name.log"
  rpc=$(sed -n 's/^rpc listening on //p' "$out/$name.ports")
  "$bench" --connect "$rpc" --trace "$trace" -n 100000 --seed "$round" --slo "$slo" \
    --warmup 2 --no-progress --json "$out/$name.json" >"$out/$name.txt"
  serve_stop "$mpirun_pid"
  mpirun_pid=
}

read -ra fixed <<<"$layouts"
configs=(auto "${fixed[@]}")
for round in $(seq "$rounds"); do
  for config in "${configs[@]}"; do real_run "$config" "$round"; done
done

for config in "${configs[@]}"; do
  layout=$config rebalance=()
  if [[ $config == auto ]]; then
    layout=${layouts%% *}
    rebalance=(--rebalance auto)
  fi
  "$sim" --profile "$profile" --cluster "$layout" --host-cores "$(nproc)" --transfer mpi-shm \
    --trace "$trace" -n 100000 --slo "$slo" "${rebalance[@]}" \
    --json "$out/${config//+/_}_sim.json" >"$out/${config//+/_}_sim.txt" 2>&1
done

python3 - "$out" "$profile" "$slo" "$trace" "$rounds" "$(( $(date +%s) - start ))" \
  "${configs[@]}" <<'PY'
import json, pathlib, re, statistics, sys
out, profile_path, slo, trace, rounds, seconds = pathlib.Path(sys.argv[1]), *sys.argv[2:7]
configs, rounds = sys.argv[7:], int(rounds)
profile = json.loads(pathlib.Path(profile_path).read_text())
change = re.compile(r"rebalancer: instance (\d+) (\w+) -> (\w+)")
print(f"{profile['device']}; trace {pathlib.Path(trace).name}; SLO {slo} ms (p90 targets for the "
      f"rebalancer, per-request bounds for goodput); one compute thread per instance rank; "
      f"{rounds} rounds, configurations alternating\n")
print("| configuration | requests within the SLO, each round | median | goodput req/s, median | "
      "simulated | role changes (real, each round) | simulated changes |")
print("|---|---|---:|---:|---:|---|---|")
for config in configs:
    name = config.replace("+", "_")
    goodputs, shares, changes = [], [], []
    for r in range(1, rounds + 1):
        summary = json.loads((out / f"{name}_r{r}.json").read_text())["runs"][0]["summary"]
        goodputs.append(summary["goodput"])
        shares.append(summary["goodput_fraction"] * 100)
        log = (out / f"{name}_r{r}.log").read_text()
        changes.append(" ".join(f"{m[0]}:{m[1][0].upper()}>{m[2][0].upper()}"
                                for m in change.findall(log)) or "none")
    sim = json.loads((out / f"{name}_sim.json").read_text())
    simulated = sim["runs"][0]["summary"]["goodput_fraction"] * 100
    sim_changes = " ".join(f"{c['instance']}:{c['from'][0].upper()}>{c['to'][0].upper()}"
                           f"@{c['at_s']:.0f}s" for c in sim["simulation"][0]["role_changes"])
    label = f"{configs[1]} + rebalancer" if config == "auto" else f"{config} fixed"
    print(f"| {label} | {', '.join(f'{s:.1f}%' for s in shares)} | "
          f"{statistics.median(shares):.1f}% | {statistics.median(goodputs):.3f} | "
          f"{simulated:.1f}% | {'; '.join(changes)} | {sim_changes or 'none'} |")
print(f"\n{seconds} s in all")
PY
