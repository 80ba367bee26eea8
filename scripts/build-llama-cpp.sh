#!/usr/bin/env bash
# Build llama.cpp (CPU) from the llama-cpp-python source distribution, for the GGUF cross-check
# (tests/test_gguf.py, docs/gguf.md).
#
#   scripts/build-llama-cpp.sh            # a second run is a no-op
#
# A first build takes a while: 26 minutes measured here (JOBS=2, nice -n 10, on 2 cores other work was
# using); most of it is llama.cpp's `common` library, which llama-tokenize and llama-bench need.
# TARGETS=llama-simple builds only libllama + llama-simple, enough for the tests' probe.
#
# Everything lives in a cache dir, never in the repository:
#   ${CLOVER_LLAMA_CPP_DIR:-${XDG_CACHE_HOME:-~/.cache}/clover/llama.cpp}/
#     sdist/   llama_cpp_python-$VERSION.tar.gz      (pip download --no-deps --no-binary :all:)
#     src/     the unpacked sdist; its vendor/llama.cpp is the matching llama.cpp tree
#     build/   cmake build; build/bin/ holds llama-simple, llama-tokenize, llama-bench, libllama.so
#     bin/     clover-llama-probe (tokenize / greedy / logits, for the tests) + READY marker
# Environment: PYTHON (the interpreter whose pip downloads; default: python3), JOBS (default: nproc),
# TARGETS (default: llama-simple llama-tokenize llama-bench llama-batched-bench llama-diffusion-cli
# llama-speculative-simple; the last runs DFlash drafters for `clover bench peers`' llama.cpp-dflash row).
# PORT=1 also builds bin/llama-clover, the Clover port (ports/llama.cpp, docs/llama-port.md), against
# this build's ggml; the stock build itself is unchanged, and a second run rebuilds only the port.
set -euo pipefail

VERSION="0.3.36"
CACHE="${CLOVER_LLAMA_CPP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/clover/llama.cpp}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
TARGETS="${TARGETS:-llama-simple llama-tokenize llama-bench llama-batched-bench llama-diffusion-cli llama-speculative-simple}"
SRC="$CACHE/src/llama_cpp_python-$VERSION"
LLAMA="$SRC/vendor/llama.cpp"
BUILD="$CACHE/build"
BIN="$CACHE/bin"
READY="$BIN/READY"

build_port() {  # PORT=1: the Clover port, one translation unit (clover-llama.cpp and its .inc parts) against the stock build's ggml
  local repo
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  echo "== building llama-clover (ports/llama.cpp)"
  c++ -O3 -march=native -std=c++17 "$repo/ports/llama.cpp/clover-llama.cpp" -o "$BIN/llama-clover" \
    -I "$LLAMA/include" -I "$LLAMA/ggml/include" -I "$LLAMA/vendor" -L "$BUILD/bin" -lllama -lggml -lggml-base -lggml-cpu \
    -Wl,-rpath,"$BUILD/bin"
  echo "done: $BIN/llama-clover"
}

if [[ -f "$READY" && "$(cat "$READY")" == "llama-cpp-python==$VERSION" ]]; then
  echo "llama.cpp already built: $BUILD/bin (remove $READY to rebuild)"
  if [[ "${PORT:-0}" == 1 ]]; then build_port; fi
  exit 0
fi
for tool in cmake c++ tar; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found (needed to build llama.cpp)" >&2; exit 1; }
done

mkdir -p "$CACHE/sdist" "$CACHE/src" "$BIN"
SDIST="$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
  echo "== downloading llama-cpp-python==$VERSION (source distribution)"
  "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/sdist"
fi
if [[ ! -f "$LLAMA/CMakeLists.txt" ]]; then
  echo "== unpacking into $CACHE/src"
  tar xzf "$SDIST" -C "$CACHE/src"
fi

# -march=native compiles AMX in where the CPU advertises it, but some VMs advertise AMX without enabling its
# state (the kernel grants the permission, the first tile instruction still faults: SIGILL in ggml's AMX
# matmul on every quantized GGUF). Run one tile instruction first; if it faults, build without AMX.
NATIVE_FLAGS=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  cat >"$CACHE/amx-check.c" <<'EOF_AMX'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
  unsigned char cfg[64];
  if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2; /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
  memset(cfg, 0, sizeof cfg); cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;
  _tile_loadconfig(cfg); _tile_zero(0); _tile_release();
  return 0;
}
EOF_AMX
  if ! { cc -O2 -mamx-tile "$CACHE/amx-check.c" -o "$CACHE/amx-check" 2>/dev/null && sh -c '"$1"; exit $?' amx-check "$CACHE/amx-check" 2>/dev/null; }; then
    NATIVE_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    echo "== this CPU advertises AMX but cannot run it: building without AMX"
  fi
fi

echo "== configuring llama.cpp (CPU, Release, shared libs)"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$LLAMA" -B "$BUILD" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_NATIVE=ON -DGGML_OPENMP=OFF -DCMAKE_C_FLAGS="$NATIVE_FLAGS" -DCMAKE_CXX_FLAGS="$NATIVE_FLAGS" \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON >"$CACHE/cmake-configure.log"

echo "== building $TARGETS ($JOBS jobs; log: $CACHE/cmake-build.log)"
cmake --build "$BUILD" --config Release -j "$JOBS" --target $TARGETS >"$CACHE/cmake-build.log"

echo "== building clover-llama-probe"
cat >"$BIN/clover-llama-probe.cpp" <<'EOF'
// clover-llama-probe MODEL.gguf MODE [ARG]: the three things the GGUF cross-check needs from llama.cpp.
//   tokenize          stdin: UTF-8 text        -> stdout: token ids (special tokens parsed, no BOS)
//   greedy N [BAN..]  stdin: prompt token ids  -> stdout: N greedy (argmax) token ids; EOS is an ordinary
//                     token, the BAN ids are never picked (clover's ignore_eos bans its EOS ids the same way)
//   logits OUT.f32    stdin: token ids         -> OUT.f32: float32 [n_tokens, n_vocab], one causal pass
// Environment: CLOVER_PROBE_THREADS (default 2); CLOVER_PROBE_NO_REPACK=1: no weight repacking (extra buffer types).
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

static std::vector<llama_token> read_ids() {
    std::vector<llama_token> ids;
    long v;
    while (std::cin >> v) ids.push_back((llama_token) v);
    return ids;
}

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char ** argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s MODEL.gguf tokenize|greedy N|logits OUT\n", argv[0]); return 2; }
    const std::string mode = argv[2];
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.progress_callback = [](float, void *) { return true; };  // no loading dots on stderr
    if (getenv("CLOVER_PROBE_NO_REPACK")) mp.use_extra_bufts = false;  // no weight repacking (it dies with SIGILL on some VMs)
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "error: cannot load %s\n", argv[1]); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    if (mode == "tokenize") {
        std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
        int n = -llama_tokenize(vocab, text.data(), (int) text.size(), nullptr, 0, false, true);
        std::vector<llama_token> ids(n);
        if (n > 0 && llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), n, false, true) != n) return 1;
        for (size_t i = 0; i < ids.size(); i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
        llama_model_free(model);
        return 0;
    }

    std::vector<llama_token> ids = read_ids();
    if (ids.empty()) { fprintf(stderr, "error: no token ids on stdin\n"); return 1; }
    const int n_new = mode == "greedy" ? atoi(argc > 3 ? argv[3] : "64") : 0;
    const int threads = getenv("CLOVER_PROBE_THREADS") ? atoi(getenv("CLOVER_PROBE_THREADS")) : 2;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (ids.size() + n_new + 16);
    cp.n_batch = cp.n_ctx;
    cp.n_ubatch = cp.n_ctx;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "error: cannot create a context\n"); return 1; }

    llama_batch batch = llama_batch_init((int) ids.size(), 0, 1);
    batch.n_tokens = (int) ids.size();
    const bool all = mode == "logits";
    for (int i = 0; i < batch.n_tokens; i++) {
        batch.token[i] = ids[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = all || i == batch.n_tokens - 1;
    }
    if (llama_decode(ctx, batch)) { fprintf(stderr, "error: llama_decode failed\n"); return 1; }

    if (all) {
        if (argc < 4) { fprintf(stderr, "error: logits needs an output path\n"); return 2; }
        FILE * f = fopen(argv[3], "wb");
        if (!f) { perror(argv[3]); return 1; }
        for (int i = 0; i < batch.n_tokens; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, f);
        fclose(f);
    } else if (mode == "greedy") {
        std::set<llama_token> banned;
        for (int a = 4; a < argc; a++) banned.insert((llama_token) atoi(argv[a]));
        for (int k = 0; k < n_new; k++) {
            const float * lg = llama_get_logits_ith(ctx, -1);
            llama_token best = -1;
            for (int t = 0; t < n_vocab; t++) {
                if (banned.count(t)) continue;
                if (best < 0 || lg[t] > lg[best]) best = t;
            }
            printf(k ? " %d" : "%d", best);
            llama_batch one = llama_batch_get_one(&best, 1);
            if (llama_decode(ctx, one)) { fprintf(stderr, "error: llama_decode failed\n"); return 1; }
        }
        printf("\n");
    } else {
        fprintf(stderr, "error: unknown mode %s\n", mode.c_str());
        return 2;
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
EOF
c++ -O2 -std=c++17 "$BIN/clover-llama-probe.cpp" -o "$BIN/clover-llama-probe" \
  -I "$LLAMA/include" -I "$LLAMA/ggml/include" -L "$BUILD/bin" -lllama -lggml -lggml-base \
  -Wl,-rpath,"$BUILD/bin"

echo "llama-cpp-python==$VERSION" >"$READY"
echo "done: $BUILD/bin ($TARGETS), $BIN/clover-llama-probe"
if [[ "${PORT:-0}" == 1 ]]; then build_port; fi
