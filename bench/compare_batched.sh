#!/usr/bin/env bash
# Aggregate decode throughput of the batching engine against llama.cpp's
# llama-batched-bench on the same GGUF, in one run: 128-token prompts, 128
# generated tokens, batches of 1..64 sequences, 2 threads. The engines take
# turns ROUNDS times; the table reports medians over rounds, and a PNG plot.
# The model is any GGUF path (default: SmolLM2-135M Q4_1), or, with SHAPE
# set instead, a synthetic model that tests/gpu/synthetic_model.py writes into
# a temporary folder (under TMPDIR; deleted on exit): SHAPE is one of its
# --shape names (llama3.2-1b, llama3-8b, qwen2.5-7b, qwen3-0.6b, qwen3-8b,
# smollm2-135m), TYPE its --type (q4_0 by default; q4_k_m, q4_k, q6_k, q4_1, q8_0), LAYERS fewer
# layers than the shape's (all by default). llama-batched-bench runs in its
# defaults (flash attention `auto`); PEER_ARGS adds options to it (e.g. `-fa 0`).
# Usage: bench/compare_batched.sh [MODEL]
#   env: ROUNDS=3 THREADS=2 BATCHES=1,2,4,8,16,32,64 OUT=docs/batched_decode.png PEER_ARGS=
#        SHAPE=llama3.2-1b TYPE=q4_k_m [LAYERS=N] bench/compare_batched.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:-}
if [ -n "${SHAPE:-}" ] && [ -n "$model" ]; then
  echo "give a MODEL path or SHAPE, not both" >&2
  exit 1
fi
if [ -z "${SHAPE:-}" ] && [ -n "${TYPE:-}${LAYERS:-}" ]; then
  echo "TYPE and LAYERS describe a synthetic model: set SHAPE too" >&2
  exit 1
fi
model=${model:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
rounds=${ROUNDS:-3}
threads=${THREADS:-2}
plot=${OUT:-$root/docs/batched_decode.png}
batches=${BATCHES:-1,2,4,8,16,32,64}
duet_bench=${DUET_BUILD_DIR:-$root/build}/bench/duet-engine-bench
TARGETS="llama-batched-bench" "$root/bench/build_llama_cpp.sh" >/dev/null
llama_bb=$root/.cache/llama.cpp-build/bin/llama-batched-bench
[ -x "$duet_bench" ] || { echo "build Duet first (launch/build.sh)" >&2; exit 1; }

cpu_field() { grep -m1 "^$1" /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'; }
echo "CPU: $(cpu_field 'model name') (family $(cpu_field 'cpu family'), model $(cpu_field 'model\s*:' || true)), $(nproc) cores" >&2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if [ -n "${SHAPE:-}" ]; then
  model=$out/synthetic-$SHAPE-${TYPE:-q4_0}${LAYERS:+-${LAYERS}layers}.gguf
  synth=(--shape "$SHAPE" --type "${TYPE:-q4_0}" --out "$model")
  [ -z "${LAYERS:-}" ] || synth+=(--layers "$LAYERS")
  python3 "$root/tests/gpu/synthetic_model.py" "${synth[@]}"
fi
for round in $(seq "$rounds"); do
  echo "round $round/$rounds" >&2
  "$duet_bench" -m "$model" --batch "$batches" -p 128 -n 128 -t "$threads" -r 1 --json >"$out/duet-$round.json"
  # shellcheck disable=SC2086 # PEER_ARGS: words
  "$llama_bb" -m "$model" -npp 128 -ntg 128 -npl "$batches" -c 16384 -t "$threads" ${PEER_ARGS:-} \
    --output-format jsonl >"$out/llama-$round.jsonl" 2>/dev/null
done

python3 - "$out" "$rounds" "$model" "$plot" <<'PY'
import json, pathlib, statistics, sys
out, rounds, model, plot = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
duet, llama = {}, {}
for r in range(1, rounds + 1):
    for row in json.loads((out / f"duet-{r}.json").read_text()):
        duet.setdefault(row["batch"], []).append(row["decode_tps"])
    for line in (out / f"llama-{r}.jsonl").read_text().splitlines():
        if line.strip().startswith("{"):
            row = json.loads(line)
            llama.setdefault(row["pl"], []).append(row["speed_tg"])
batches = sorted(duet)
d = {b: statistics.median(duet[b]) for b in batches}
l = {b: statistics.median(llama[b]) for b in batches if b in llama}
print(f"model: {pathlib.Path(model).name}; 128-token prompts, 128 generated; {rounds} alternating rounds; medians\n")
print("| batch | Duet decode t/s | llama.cpp decode t/s | Duet / llama.cpp | Duet / Duet batch 1 |")
print("|---:|---:|---:|---:|---:|")
for b in batches:
    print(f"| {b} | {d[b]:.1f} | {l.get(b, float('nan')):.1f} | {d[b] / l.get(b, float('nan')):.2f}x | {d[b] / d[batches[0]]:.2f}x |")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(batches, [d[b] for b in batches], "o-", label="Duet")
    ax.plot([b for b in batches if b in l], [l[b] for b in batches if b in l], "s--", label="llama.cpp")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences in the batch")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title(pathlib.Path(model).name + ", 2 threads")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot)
    print(f"\nplot: {plot}")
except ImportError:
    print("\n(no plot: install python3-matplotlib)")
PY
