#!/usr/bin/env bash
# Duet against llama.cpp on the same GGUF, in one run: prompt processing
# (pp512) and generation (tg128) at 1 and 2 threads. The two engines take
# turns, ROUNDS times (each turn runs every test REPS times), so both see the
# same machine noise; the table reports the median over rounds of each turn's
# mean, and Duet's ratio to llama.cpp.
# Usage: bench/compare_llama_cpp.sh [MODEL]   (env: ROUNDS=3 REPS=5 THREADS=1,2)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
rounds=${ROUNDS:-3}
reps=${REPS:-5}
threads=${THREADS:-1,2}
duet_bench=${DUET_BUILD_DIR:-$root/build}/bench/duet-engine-bench
llama_bench=$("$root/bench/build_llama_cpp.sh" | tail -n 1)
[ -x "$duet_bench" ] || { echo "build Duet first (launch/build.sh)" >&2; exit 1; }

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for round in $(seq "$rounds"); do
  echo "round $round/$rounds" >&2
  OPENBLAS_NUM_THREADS=1 "$duet_bench" -m "$model" -p 512 -n 128 -t "$threads" -r "$reps" --json \
    >"$out/duet-$round.json"
  "$llama_bench" -m "$model" -p 512 -n 128 -t "$threads" -fa 0 -r "$reps" -o json \
    >"$out/llama-$round.json" 2>/dev/null
done

python3 - "$out" "$rounds" "$model" <<'PY'
import json, pathlib, statistics, sys
out, rounds, model = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
duet, llama = {}, {}
for r in range(1, rounds + 1):
    for row in json.loads((out / f"duet-{r}.json").read_text()):
        duet.setdefault((row["test"], row["threads"]), []).append(row["mean"])
    for row in json.loads((out / f"llama-{r}.json").read_text()):
        test = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        llama.setdefault((test, row["n_threads"]), []).append(row["avg_ts"])
print(f"model: {pathlib.Path(model).name}; {rounds} alternating rounds; median of the rounds' means\n")
print("| test | threads | Duet t/s | llama.cpp t/s | Duet / llama.cpp |")
print("|---|---:|---:|---:|---:|")
for key in sorted(duet, key=lambda k: (k[0][:2] != "pp", k[1])):
    d, l = statistics.median(duet[key]), statistics.median(llama.get(key, [float("nan")]))
    print(f"| {key[0]} | {key[1]} | {d:.1f} | {l:.1f} | {d / l:.2f}x |")
PY
