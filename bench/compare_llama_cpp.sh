#!/usr/bin/env bash
# Duet against llama.cpp on the same GGUF, in one run: prompt processing
# (ppN) and generation (tgN). The engines take turns, ROUNDS times (each turn
# runs every test REPS times), so both see the same machine noise; the table
# reports the median over rounds of each turn's mean, and Duet's ratio to the
# best llama.cpp configuration of the row.
#
# llama.cpp runs as its users run it: its defaults (flash attention `auto`,
# weight repacking on where its CPU backend has a layout for the machine).
# PEER_CONFIGS adds more configurations, '|'-separated llama-bench arguments
# (`default` for none), e.g. 'default|-fa off|-fa on' for long prompts. When a
# configuration crashes on this machine (llama.cpp's AMX prefill does on some
# VMs) the run says so, retries it once with `--repack 0` and labels the
# column, rather than comparing with nothing.
#
# The model is any GGUF path (default: SmolLM2-135M Q4_1), or, with SHAPE
# set instead, a synthetic model that tests/gpu/synthetic_model.py writes into
# a temporary folder (under TMPDIR; deleted on exit): SHAPE is one of its
# --shape names (llama3.2-1b, llama3-8b, qwen2.5-7b, qwen3-0.6b, qwen3-8b,
# gemma3-1b, smollm2-135m), TYPE its --type (q4_0 by default; q4_k_m, q4_k, q6_k, q4_1, q8_0), LAYERS fewer
# layers than the shape's (all by default).
#
# Usage: bench/compare_llama_cpp.sh [MODEL]
#        SHAPE=llama3.2-1b TYPE=q4_k_m [LAYERS=N] bench/compare_llama_cpp.sh
#   env: ROUNDS=3 REPS=5 THREADS=1,2 PROMPTS=512 GENS=128 (0: no tg test)
#        DEPTHS=0 (e.g. 0,4096: each test also after that many tokens in the
#        cache, llama-bench's -d) PEER_CONFIGS=default
#        MEMBW=1 (0: skip) reads duet-membw at the start of every round and
#        prints its range per thread count under the table: on a shared VM the
#        memory's rate moves from minute to minute, so generation's share of
#        it is only meaningful against a reading from the same run.
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
reps=${REPS:-5}
threads=${THREADS:-1,2}
prompts=${PROMPTS:-512}
gens=${GENS:-128}
depths=${DEPTHS:-0}
peer_configs=${PEER_CONFIGS:-default}
duet_bench=${DUET_BUILD_DIR:-$root/build}/bench/duet-engine-bench
membw=${DUET_BUILD_DIR:-$root/build}/bench/duet-membw
max_threads=$(tr ',' '\n' <<<"$threads" | sort -n | tail -n 1)
llama_bench=$("$root/bench/build_llama_cpp.sh" | tail -n 1)
[ -x "$duet_bench" ] || { echo "build Duet first (launch/build.sh)" >&2; exit 1; }

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if [ -n "${SHAPE:-}" ]; then
  model=$out/synthetic-$SHAPE-${TYPE:-q4_0}${LAYERS:+-${LAYERS}layers}.gguf
  synth=(--shape "$SHAPE" --type "${TYPE:-q4_0}" --out "$model")
  [ -z "${LAYERS:-}" ] || synth+=(--layers "$LAYERS")
  python3 "$root/tests/gpu/synthetic_model.py" "${synth[@]}"
fi
IFS='|' read -r -a configs <<<"$peer_configs"
cpu_field() { grep -m1 "^$1" /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'; }
isa=$(grep -m1 '^flags' /proc/cpuinfo | grep -o -w -E 'avx512f|avx512_vnni|avx512_bf16|avx512_fp16|amx_tile' | tr '\n' ' ' || true)
echo "CPU: $(cpu_field 'model name') (family $(cpu_field 'cpu family'), model $(cpu_field 'model\s*:' || true)), $(nproc) cores; ${isa:-no AVX-512}" >&2
for round in $(seq "$rounds"); do
  echo "round $round/$rounds" >&2
  if [ "${MEMBW:-1}" != 0 ] && [ -x "$membw" ]; then
    "$membw" --mib 1024 --passes 3 --threads "$max_threads" >"$out/membw-$round.txt"
  fi
  OPENBLAS_NUM_THREADS=1 "$duet_bench" -m "$model" -p "$prompts" -n "$gens" -d "$depths" \
    -t "$threads" -r "$reps" --json >"$out/duet-$round.json"
  for i in "${!configs[@]}"; do
    config=${configs[$i]}
    args=()
    [ "$config" = default ] || read -r -a args <<<"$config"
    if [ -f "$out/fallback-$i" ]; then args+=(--repack 0); fi
    if ! "$llama_bench" -m "$model" -p "$prompts" -n "$gens" -d "$depths" -t "$threads" \
      -r "$reps" "${args[@]}" -o json >"$out/llama-$i-$round.json" 2>"$out/llama-$i.err"; then
      if [ -f "$out/fallback-$i" ] || [[ " ${args[*]} " == *" --repack "* ]]; then
        echo "llama.cpp ($config) failed:" >&2
        tail -n 5 "$out/llama-$i.err" >&2
        exit 1
      fi
      echo "llama.cpp ($config) crashed on this machine ($(tail -n 1 "$out/llama-$i.err"));" \
        "retrying with --repack 0" >&2
      touch "$out/fallback-$i"
      "$llama_bench" -m "$model" -p "$prompts" -n "$gens" -d "$depths" -t "$threads" \
        -r "$reps" "${args[@]}" --repack 0 -o json >"$out/llama-$i-$round.json" 2>"$out/llama-$i.err"
    fi
  done
done

python3 - "$out" "$rounds" "$model" "$peer_configs" <<'PY'
import json, pathlib, statistics, sys
out, rounds, model, configs = (pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                               sys.argv[4].split("|"))
duet, peers = {}, [dict() for _ in configs]
for r in range(1, rounds + 1):
    for row in json.loads((out / f"duet-{r}.json").read_text()):
        duet.setdefault((row["test"], row["threads"]), []).append(row["mean"])
    for i in range(len(configs)):
        for row in json.loads((out / f"llama-{i}-{r}.json").read_text()):
            test = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
            if row.get("n_depth"):
                test += f" @ d{row['n_depth']}"
            peers[i].setdefault((test, row["n_threads"]), []).append(row["avg_ts"])
names = []
for i, config in enumerate(configs):
    name = "llama.cpp " + ("default" if config == "default" else config)
    if (out / f"fallback-{i}").exists():
        name += " (crashed; --repack 0)"
    names.append(name)
print(f"model: {pathlib.Path(model).name}; {rounds} alternating rounds; median of the rounds' means\n")
print("| test | threads | Duet t/s | " + " | ".join(f"{n} t/s" for n in names) +
      " | Duet / best llama.cpp |")
print("|---|---:|---:|" + "---:|" * len(names) + "---:|")
def order(key):
    test, threads = key
    size, _, depth = test[2:].partition(" @ d")
    return (test[:2] != "pp", int(depth or 0), int(size), threads)
for key in sorted(duet, key=order):
    d = statistics.median(duet[key])
    p = [statistics.median(peer[key]) if key in peer else float("nan") for peer in peers]
    best = max((x for x in p if x == x), default=float("nan"))
    print(f"| {key[0]} | {key[1]} | {d:.1f} | " + " | ".join(f"{x:.1f}" for x in p) +
          f" | {d / best:.2f}x |")
membw = {}
for r in range(1, rounds + 1):
    path = out / f"membw-{r}.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 2 and cells[0].isdigit():
            membw.setdefault(int(cells[0]), []).append(float(cells[1]))
if membw:
    print("\nduet-membw at each round's start, GB/s: " + "; ".join(
        f"{t} thread{'s' if t > 1 else ''} {min(v):.1f}-{max(v):.1f} (median {statistics.median(v):.1f})"
        for t, v in sorted(membw.items())))
PY
