#!/usr/bin/env bash
# Build the peers that benchmarks/compare measures, from registry packages only:
#
#   benchmarks/.peers-venv          llama-cpp-python[server] built from its sdist for this CPU
#                                   (its own venv: the project venv stays clean, no torch here)
#   benchmarks/.cache/llama.cpp-build/bin/
#                                   llama.cpp's own tools, built from the llama.cpp sources
#                                   vendored in the same sdist (same llama.cpp commit):
#                                   llama-server (serving), llama-quantize (the requantized
#                                   models of benchmarks/models.sh), llama-bench (pp / tg
#                                   tok/s), llama-perplexity and llama-batched-bench (the
#                                   quant step), llama-imatrix (the importance matrix
#                                   llama-quantize needs for the 2-bit i-quants)
#
# All are native builds (-DGGML_NATIVE=ON: -march=native), the way a user would build them
# here. Idempotent: a step whose output exists is skipped, and so is each tool already built.
# Build outputs are gitignored. On 2 cores expect ~5-10 minutes for llama-cpp-python and
# ~10-15 for the tools (one cmake build dir: the libraries are built once for all of them).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${PEERS_VENV:-$HERE/.peers-venv}"
CACHE="$HERE/.cache"
LCP_VERSION="${LCP_VERSION:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"
PY="${PYTHON:-python3}"
SDIST="$CACHE/src/llama_cpp_python-$LCP_VERSION.tar.gz"
SRC="$CACHE/src/llama_cpp_python-$LCP_VERSION"
BUILD="$CACHE/llama.cpp-build"
# llama-server first: the serving steps need it; a tool that fails to build is reported and
# the others still build (the runner records a missing tool as "not measured").
TOOLS=(llama-server llama-quantize llama-bench llama-perplexity llama-batched-bench llama-imatrix)

log() { printf '[setup_peers %s] %s\n' "$(date +%T)" "$*" >&2; }

# -march=native turns on ggml's AMX kernels where the CPU has AMX (Sapphire Rapids and
# later), and they segfault in the first matmul of this llama.cpp (ggml_backend_amx_mul_mat on
# Q4_1 / Q8_0, llama.cpp issue #20824, closed unfixed): every tool and the bindings crash. So
# on such a CPU the build keeps everything native but AMX. (GCC: an explicit -mno-* wins over
# -march=native wherever it stands.) The flags are stamped beside each build, and a build made
# with other flags is rebuilt.
NATIVE_CFLAGS=""
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    NATIVE_CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
flags_match() { [ "$(cat "$1" 2>/dev/null)" = "$NATIVE_CFLAGS" ]; }

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
if ! "$VENV/bin/python" -c "import llama_cpp, llama_cpp.server" 2>/dev/null \
        || ! flags_match "$VENV/.native-cflags"; then
    log "building llama-cpp-python $LCP_VERSION (native CPU build${NATIVE_CFLAGS:+ without AMX})"
    t0=$(date +%s)
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF '-DCMAKE_C_FLAGS=$NATIVE_CFLAGS' '-DCMAKE_CXX_FLAGS=$NATIVE_CFLAGS' \
${PEERS_CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        "$VENV/bin/pip" install -q --no-cache-dir --force-reinstall "$SDIST[server]"
    printf '%s' "$NATIVE_CFLAGS" >"$VENV/.native-cflags"
    log "llama-cpp-python built in $(( $(date +%s) - t0 ))s"
fi

# 2. llama.cpp's tools from the vendored llama.cpp, one cmake build dir. Optional: on failure
#    the runner says so (llama-server: it quotes llama.cpp's batched decode through the
#    bindings instead; the others: "not measured").
missing=()
for t in "${TOOLS[@]}"; do
    if [ ! -x "$BUILD/bin/$t" ] || ! flags_match "$BUILD/.native-cflags"; then
        missing+=("$t")
    fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    [ -d "$SRC" ] || tar xzf "$SDIST" -C "$CACHE/src"
    log "configuring llama.cpp for: ${missing[*]}${NATIVE_CFLAGS:+ (without AMX)}"
    # LLAMA_BUILD_TOOLS holds tools/ (quantize, llama-bench, perplexity, batched-bench,
    # server); it defaults to ON for a standalone build, and is said here so it stays so.
    if cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
            -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TOOLS=ON \
            -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DBUILD_SHARED_LIBS=OFF "-DCMAKE_C_FLAGS=$NATIVE_CFLAGS" \
            "-DCMAKE_CXX_FLAGS=$NATIVE_CFLAGS" ${PEERS_CMAKE_ARGS:-} \
            >"$CACHE/llama.cpp-cmake.log" 2>&1
    then
        for t in "${missing[@]}"; do
            log "building $t"
            t0=$(date +%s)
            if cmake --build "$BUILD" --target "$t" -j "$JOBS" >"$CACHE/$t-build.log" 2>&1
            then
                log "$t built in $(( $(date +%s) - t0 ))s"
            else
                log "$t did not build; see $CACHE/$t-build.log"
            fi
        done
        # Only now: an interrupted build leaves no stamp, so the next run finishes it.
        printf '%s' "$NATIVE_CFLAGS" >"$BUILD/.native-cflags"
    else
        log "llama.cpp did not configure; see $CACHE/llama.cpp-cmake.log"
    fi
fi
log "done: $VENV/bin/python, $BUILD/bin/{$(IFS=,; echo "${TOOLS[*]}")}"
