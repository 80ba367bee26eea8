// llama-clover: Clover block diffusion and self-speculative decoding on ggml (CPU).
//
// A standalone tool built against the ggml of the llama.cpp tree pinned by scripts/build-llama-cpp.sh
// (libggml*.so of the stock build, headers of the tree). It reads clover's GGUF export
// (`clover export-gguf`, docs/gguf.md): the `qwen35moe` backbone plus, for the denoise mode, Clover's
// tensors from the `.clover.gguf` sidecar (or inline); and a `llama` GGUF (llama.cpp's own converter's,
// or clover's export of a Llama model) for ar and dflash, the same graphs with the parts a Llama layer
// has (attention without gate or q/k norms, RoPE over adjacent pairs, a dense SwiGLU FFN).
// It builds its own ggml graphs:
//   - one forward = a causal *commit* part (appended to the cache: attention K/V, GDN conv + recurrent
//     state) followed by one *denoise* block (bidirectional; reads the cache, never commits to it: its
//     K/V slots past the committed length are scratch), fused layer by layer as clover's `step`
//     (design.md §2, §3.4);
//   - the GDN core (causal conv + recurrence, and the denoise branch: decayed prefix readout +
//     lambda(B) * softmax attention inside the block + the right-side conv) is two ggml custom ops
//     written here, so its arithmetic follows clover's formulas one to one; the routed experts of a
//     multi-token forward are one more custom op (moe_grouped: the tokens gathered per expert, each
//     expert one matmul); everything else is stock ggml ops (attention by ggml_flash_attn_ext).
// and runs clover's decoding loops: ar, diffusion (clover's commit rule, forward for forward) and
// speculative (lossless w.r.t. AR greedy), and dflash (AR with a DFlash block drafter, `--drafter FILE`:
// the drafter's own graph over the target's tapped hidden states; lossless). docs/llama-port.md describes it.
//
// Usage: llama-clover MODEL.gguf --mode ar|diffusion|speculative|dflash|forward [--drafter F] [options] < prompts
//   stdin: one prompt per line, as token ids separated by spaces (clover's tokenizer is exact; the
//   Python driver `clover generate --engine llama.cpp` tokenizes). Per prompt one JSON line on stdout.
//   forward: line 1 commit ids, line 2 block ids; writes f32 logits [Tc + Bd, V] to --out (every
//   commit position, then every block position) -- the test's one-forward comparison.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "gguf.h"
#include "llama.h"
#include "nlohmann/json.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <chrono>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <fstream>
#include <functional>
#include <numeric>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

static void die(const std::string & msg) {
    fprintf(stderr, "llama-clover: error: %s\n", msg.c_str());
    exit(1);
}


// The port is one translation unit (every helper static, the hot ops inlined where they are used), kept in
// files by concern; each part reads what the parts before it define.
#include "model.inc"
#include "ops.inc"
#include "forward.inc"
#include "decoding.inc"
#include "policies.inc"
#include "verify.inc"
#include "server.inc"
