#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, -DDUET_FUZZ=ON) in build-fuzz/ and runs one of them.
#
#   tests/fuzz/run.sh FUZZER [SECONDS] [LIBFUZZER_ARGS...]
#       FUZZER: gguf | tokenizer | openai_api | capnp_request
#   tests/fuzz/run.sh build                                  only build them all
#
# SECONDS defaults to 60. The fuzzer runs as one process on a working corpus in
# build-fuzz/fuzz/FUZZER/corpus/, seeded from tests/fuzz/corpus/<FUZZER>/ (the tree's corpus is
# only read); crashes, leaks and timeouts land in build-fuzz/fuzz/FUZZER/artifacts/ and the full
# log in build-fuzz/fuzz/FUZZER/last.log. Prints libFuzzer's final stats and exits with its
# status. Extra arguments go to libFuzzer (they override the defaults below).
#
# Environment: DUET_FUZZ_BUILD_DIR (default: build-fuzz), JOBS (build jobs, default 2),
# DUET_FUZZ_MODEL (tokenizer: the GGUF whose vocabulary is fuzzed; default: the default model).
#
# To replay one input: build-fuzz/tests/fuzz/FUZZER_fuzz FILE   (add -runs=0 DIR for a folder).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${DUET_FUZZ_BUILD_DIR:-$root/build-fuzz}"
jobs="${JOBS:-2}"

usage() {
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
[[ $# -ge 1 ]] || usage
fuzzer="$1"
shift
case "$fuzzer" in
  gguf | tokenizer | openai_api | capnp_request | build) ;;
  *) usage ;;
esac

if ! grep -q 'add_subdirectory(tests/fuzz)' "$root/CMakeLists.txt"; then
  echo "run.sh: the top-level CMakeLists.txt does not add tests/fuzz yet; it needs" >&2
  echo '  option(DUET_FUZZ "Build the libFuzzer targets of tests/fuzz (Clang only)" OFF)' >&2
  echo '  if(DUET_FUZZ) add_subdirectory(tests/fuzz) endif()' >&2
  exit 1
fi

if [[ ! -f "$build/CMakeCache.txt" ]]; then
  cmake -S "$root" -B "$build" \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=Debug -DDUET_FUZZ=ON -DDUET_CUDA=OFF
fi
if [[ "$fuzzer" == build ]]; then
  cmake --build "$build" --target gguf_fuzz tokenizer_fuzz openai_api_fuzz capnp_request_fuzz \
    -j "$jobs"
  exit 0
fi
cmake --build "$build" --target "${fuzzer}_fuzz" -j "$jobs"

seconds=60
if [[ $# -ge 1 && "$1" =~ ^[0-9]+$ ]]; then
  seconds="$1"
  shift
fi

work="$build/fuzz/$fuzzer"
mkdir -p "$work/corpus" "$work/artifacts"
# New seeds are added; what earlier runs found stays.
cp -n "$root/tests/fuzz/corpus/$fuzzer/"* "$work/corpus/"

# The fuzzer's dictionary, where it has one.
dict=()
case "$fuzzer" in
  openai_api) dict=(-dict="$root/tests/fuzz/openai.dict") ;;
  capnp_request) ;;
  *) dict=(-dict="$root/tests/fuzz/$fuzzer.dict") ;;
esac

log="$work/last.log"
status=0
# The working corpus first: libFuzzer writes new inputs only into the first folder.
"$build/tests/fuzz/${fuzzer}_fuzz" \
  -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=20 -print_final_stats=1 \
  "${dict[@]}" -artifact_prefix="$work/artifacts/" \
  "$@" "$work/corpus" >"$log" 2>&1 || status=$?

echo "== ${fuzzer}_fuzz, ${seconds} s, exit status $status; log: $log"
grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1 || true
grep -E '^Done [0-9]+ runs in' "$log" || true
grep -E '^stat::' "$log" || true
if [[ $status -ne 0 ]]; then
  echo "== the fuzzer failed; the end of its log:"
  tail -n 60 "$log"
  ls -l "$work/artifacts/"
fi
exit "$status"
