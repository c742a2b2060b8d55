#!/usr/bin/env bash
# Build llama.cpp's `llama-bench`, `llama-batched-bench` and `llama-server`
# (CPU) from the llama.cpp bundled with the llama-cpp-python 0.3.36 source
# distribution -- the same llama.cpp that the golden fixtures under
# tests/golden/ were generated with.
#
# Usage: bench/build_llama_cpp.sh            (from anywhere)
#   env JOBS=N               parallel build jobs (default 2)
#   env TARGETS="a b"        CMake targets (default "llama-bench"; e.g. add
#                            "llama-batched-bench", "llama-server" or
#                            "llama-completion")
#   env LLAMA_CPP_PYTHON_SDIST=/path/llama_cpp_python-0.3.36.tar.gz
#                            use this local sdist instead of `pip download`
#
# Steps (each skipped when its result is already there, so reruns are cheap):
#   1. pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 into .cache/
#   2. extract it to .cache/llama_cpp_python-0.3.36/
#   3. configure vendor/llama.cpp with CMake (Release, GGML_NATIVE=ON, static
#      libraries, no tests or examples, the server without its web UI, no OpenSSL,
#      nothing that downloads) into .cache/llama.cpp-build/ and build the
#      targets with -j$JOBS.
# Prints the absolute path of the first target's binary on the last line of
# stdout (llama-bench by default).
#
# Notes: llama.cpp in this version no longer has LLAMA_CURL (passing it only
# warns "deprecated and will be ignored"); its downloader uses cpp-httplib, which
# LLAMA_OPENSSL=OFF leaves without HTTPS.  LLAMA_BUILD_SERVER=ON only adds the
# server's targets (llama-server, llama-cli); the web UI it embeds is neither
# built with npm (LLAMA_BUILD_UI=OFF) nor fetched from Hugging Face
# (LLAMA_USE_PREBUILT_UI=OFF), so llama-server serves the API with an empty UI.
set -euo pipefail

VERSION=0.3.36
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$ROOT/.cache"
SDIST="$CACHE/llama_cpp_python-$VERSION.tar.gz"
SRC="$CACHE/llama_cpp_python-$VERSION"
LLAMA_SRC="$SRC/vendor/llama.cpp"
BUILD="$CACHE/llama.cpp-build"
JOBS="${JOBS:-2}"
TARGETS="${TARGETS:-llama-bench}"

log() { echo "[build_llama_cpp] $*" >&2; }

mkdir -p "$CACHE"

# 1. source distribution
if [[ ! -f "$SDIST" ]]; then
    if [[ -n "${LLAMA_CPP_PYTHON_SDIST:-}" ]]; then
        log "copying $LLAMA_CPP_PYTHON_SDIST"
        cp "$LLAMA_CPP_PYTHON_SDIST" "$SDIST.tmp"
        mv "$SDIST.tmp" "$SDIST"
    else
        log "downloading llama-cpp-python==$VERSION sdist"
        tmp="$(mktemp -d "$CACHE/dl.XXXXXX")"
        python3 -m pip download --no-deps --no-binary :all: \
            "llama-cpp-python==$VERSION" -d "$tmp" >&2
        mv "$tmp/llama_cpp_python-$VERSION.tar.gz" "$SDIST"
        rm -rf "$tmp"
    fi
fi

# 2. extract
if [[ ! -f "$LLAMA_SRC/CMakeLists.txt" ]]; then
    log "extracting $SDIST"
    rm -rf "$SRC"
    tar -xzf "$SDIST" -C "$CACHE"
fi
[[ -f "$LLAMA_SRC/CMakeLists.txt" ]] || { log "no vendor/llama.cpp in $SDIST"; exit 1; }

# 3. configure (re-running the configure step is cheap and keeps options current)
GEN=()
if command -v ninja >/dev/null 2>&1 && [[ ! -f "$BUILD/Makefile" ]]; then GEN=(-G Ninja); fi
log "configuring $LLAMA_SRC -> $BUILD"
cmake -S "$LLAMA_SRC" -B "$BUILD" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DGGML_CCACHE=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_LLGUIDANCE=OFF >&2

# 4. build
log "building $TARGETS with -j$JOBS"
# shellcheck disable=SC2086
cmake --build "$BUILD" --config Release -j "$JOBS" --target $TARGETS >&2

for target in $TARGETS; do
    [[ -x "$BUILD/bin/$target" ]] || { log "$target not found at $BUILD/bin/$target"; exit 1; }
done
first=($TARGETS)
echo "$BUILD/bin/${first[0]}"
