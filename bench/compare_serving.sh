#!/usr/bin/env bash
# Serving under load, Duet against llama.cpp's llama-server, on the same GGUF,
# the same threads and the same workload: each server is started alone (one
# after the other, on a free port), driven by `duet-bench --http` at each rate
# of RATES (open loop, Poisson, the same arrivals and prompt lengths for
# both), and stopped. Writes one JSON per server (every run, every request)
# and prints a markdown table side by side: TTFT and TPOT p50/p99,
# throughput and goodput per rate.
#
# Usage: bench/compare_serving.sh [MODEL]
#   env RATES=1,2,4        request rates, req/s (the last should saturate both)
#       N=100              requests per rate
#       INPUT_LEN=128      prompt tokens (fixed), or TRACE=FILE to replay a trace's
#       OUTPUT_LEN=128     lengths (its first N rows) at each rate instead
#       THREADS=2          compute threads of both servers
#       NP=32              llama-server slots (continuous batching on); Duet runs up
#                          to 64 sequences at once by default
#       CTX_PER_SLOT=...   llama-server context per slot (default INPUT_LEN +
#                          OUTPUT_LEN + 64; 4096 with a trace)
#       SLO=ttft=1000,tpot=100   goodput's bounds, ms
#       SEED=0  OUT=.cache/compare_serving  DUET_BUILD_DIR=build
# Needs `duet` and `duet-bench` built in DUET_BUILD_DIR; builds llama-server
# with bench/build_llama_cpp.sh on first use.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
rates=${RATES:-1,2,4}
n=${N:-100}
input_len=${INPUT_LEN:-128}
output_len=${OUTPUT_LEN:-128}
trace=${TRACE:-}
threads=${THREADS:-2}
np=${NP:-32}
slo=${SLO:-ttft=1000,tpot=100}
seed=${SEED:-0}
out=${OUT:-$root/.cache/compare_serving}
build=${DUET_BUILD_DIR:-$root/build}
duet=$build/tools/duet
bench=$build/bench/duet-bench
if [[ -n "$trace" ]]; then ctx_per_slot=${CTX_PER_SLOT:-4096}; else
  ctx_per_slot=${CTX_PER_SLOT:-$((input_len + output_len + 64))}; fi

[[ -x "$duet" && -x "$bench" ]] || { echo "build duet and duet-bench in $build first" >&2; exit 1; }
[[ -f "$model" ]] || { echo "no model at $model" >&2; exit 1; }
llama_server=$(TARGETS=llama-server "$root/bench/build_llama_cpp.sh" | tail -n 1)
mkdir -p "$out"

workload=(--rate "$rates" -n "$n" --seed "$seed" --slo "$slo" --warmup 4 --no-progress)
if [[ -n "$trace" ]]; then workload+=(--trace "$trace"); else
  workload+=(--input-len "$input_len" --output-len "$output_len"); fi

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

server_pid=
stop_server() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid"; wait "$server_pid" 2>/dev/null || true
  fi
  server_pid=
}
trap stop_server EXIT

# wait_health URL LOG: until GET URL/health answers 200 (both servers have it).
wait_health() {
  for _ in $(seq 600); do
    if curl -sf "$1/health" >/dev/null 2>&1; then return 0; fi
    kill -0 "$server_pid" 2>/dev/null || { echo "server exited; log: $2" >&2; tail -n 20 "$2" >&2; exit 1; }
    sleep 0.2
  done
  echo "server did not come up; log: $2" >&2; exit 1
}

# bench NAME URL: drives the server at URL through every rate.
bench() {
  echo "[compare_serving] $1: rates $rates, $n requests each" >&2
  "$bench" --http "$2" "${workload[@]}" --json "$out/$1.json" >"$out/$1.txt"
}

port=$(free_port)
"$duet" serve --model "$model" --threads "$threads" --host 127.0.0.1 --http-port "$port" \
  --rpc-port 0 >"$out/duet-serve.log" 2>&1 &
server_pid=$!
wait_health "http://127.0.0.1:$port" "$out/duet-serve.log"
bench duet "http://127.0.0.1:$port"
stop_server

port=$(free_port)
"$llama_server" -m "$model" -t "$threads" -tb "$threads" --host 127.0.0.1 --port "$port" \
  -np "$np" -cb -c $((np * ctx_per_slot)) -fa off >"$out/llama-server.log" 2>&1 &
server_pid=$!
wait_health "http://127.0.0.1:$port" "$out/llama-server.log"
bench llama-server "http://127.0.0.1:$port"
stop_server

python3 - "$out" "$model" "$threads" "$slo" <<'PY'
import json, pathlib, sys
out, model, threads, slo = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
engines = {name: json.loads((out / f"{name}.json").read_text()) for name in ("duet", "llama-server")}
config = engines["duet"]["config"]
print(f"model: {pathlib.Path(model).name}; {threads} threads; input {config['input_len']}, "
      f"output {config['output_len']} tokens; {config['num_requests']} requests per rate; "
      f"Poisson arrivals; SLO {slo} ms\n")
print("| rate req/s | server | ok | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | req/s | out tok/s | goodput req/s |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for i, run in enumerate(engines["duet"]["runs"]):
    for name, report in engines.items():
        s = report["runs"][i]["summary"]
        print(f"| {run['rate']} | {name} | {s['n_ok']}/{s['n_requests']} | "
              f"{s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p99']:.0f} | {s['tpot_ms']['p50']:.1f} | "
              f"{s['tpot_ms']['p99']:.1f} | {s['request_rate']:.2f} | {s['output_token_rate']:.1f} | "
              f"{s['goodput']:.2f} |")
print(f"\n(latencies in ms; per-request JSON in {out})")
PY
