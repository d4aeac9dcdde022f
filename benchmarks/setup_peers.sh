#!/usr/bin/env bash
# Build the peers that benchmarks/compare measures, from registry packages only:
#
#   benchmarks/.peers-venv          llama-cpp-python[server] built from its sdist for this CPU
#                                   (its own venv: the project venv stays clean, no torch here)
#   benchmarks/.cache/llama.cpp/    llama.cpp's own `llama-server`, built from the llama.cpp
#                                   sources vendored in the same sdist (same llama.cpp commit)
#
# Both are native builds (-DGGML_NATIVE=ON: -march=native), the way a user would build them
# here. Idempotent: a step whose output exists is skipped. Build outputs are gitignored.
# On 2 cores expect ~5-10 minutes for each of the two builds.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${PEERS_VENV:-$HERE/.peers-venv}"
CACHE="$HERE/.cache"
LCP_VERSION="${LCP_VERSION:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"
PY="${PYTHON:-python3}"
SDIST="$CACHE/src/llama_cpp_python-$LCP_VERSION.tar.gz"
SRC="$CACHE/src/llama_cpp_python-$LCP_VERSION"
SERVER_BUILD="$CACHE/llama.cpp-build"

log() { printf '[setup_peers %s] %s\n' "$(date +%T)" "$*" >&2; }

mkdir -p "$CACHE/src"
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi
if [ ! -f "$SDIST" ]; then
    log "downloading the llama-cpp-python $LCP_VERSION sdist"
    "$VENV/bin/pip" download -q --no-binary :all: --no-deps -d "$CACHE/src" \
        "llama-cpp-python==$LCP_VERSION"
fi

# 1. llama-cpp-python (the Python bindings + `python -m llama_cpp.server`).
if ! "$VENV/bin/python" -c "import llama_cpp, llama_cpp.server" 2>/dev/null; then
    log "building llama-cpp-python $LCP_VERSION (native CPU build)"
    t0=$(date +%s)
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF ${PEERS_CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        "$VENV/bin/pip" install -q "$SDIST[server]"
    log "llama-cpp-python built in $(( $(date +%s) - t0 ))s"
fi

# 2. llama-server from the vendored llama.cpp. Optional: on failure the runner says so and
#    quotes llama.cpp's batched decode through the bindings instead.
if [ ! -x "$SERVER_BUILD/bin/llama-server" ]; then
    [ -d "$SRC" ] || tar xzf "$SDIST" -C "$CACHE/src"
    log "building llama-server"
    t0=$(date +%s)
    if cmake -S "$SRC/vendor/llama.cpp" -B "$SERVER_BUILD" -DCMAKE_BUILD_TYPE=Release \
            -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
            ${PEERS_CMAKE_ARGS:-} >"$CACHE/llama-server-cmake.log" 2>&1 \
        && cmake --build "$SERVER_BUILD" --target llama-server -j "$JOBS" \
            >"$CACHE/llama-server-build.log" 2>&1; then
        log "llama-server built in $(( $(date +%s) - t0 ))s"
    else
        log "llama-server did not build; see $CACHE/llama-server-*.log"
    fi
fi
log "done: $VENV/bin/python, ${SERVER_BUILD}/bin/llama-server"
