// llama-clover: Clover block diffusion and self-speculative decoding on ggml (CPU).
//
// A standalone tool built against the ggml of the llama.cpp tree pinned by scripts/build-llama-cpp.sh
// (libggml*.so of the stock build, headers of the tree). It reads clover's GGUF export
// (`clover export-gguf`, docs/gguf.md): the `qwen35moe` backbone plus, for the denoise mode, Clover's
// tensors from the `.clover.gguf` sidecar (or inline). It builds its own ggml graphs:
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

// ------------------------------------------------------------------------------------------ model
struct Layer {
    bool recurrent = false;
    ggml_tensor *attn_norm = nullptr, *post_norm = nullptr;
    // gated attention
    ggml_tensor *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr, *q_norm = nullptr, *k_norm = nullptr;
    ggml_tensor *k_cache = nullptr, *v_cache = nullptr;  // [hd, n_kv_heads, n_ctx] f32 (or f16: --kv f16)
    // gated deltanet
    ggml_tensor *wqkv = nullptr, *wgate = nullptr, *conv1d = nullptr, *dt = nullptr, *ssm_a = nullptr;
    ggml_tensor *wbeta = nullptr, *walpha = nullptr, *ssm_norm = nullptr, *ssm_out = nullptr;
    ggml_tensor *conv_right = nullptr, *intra_scale = nullptr, *gain_a = nullptr, *gain_b = nullptr;  // Clover
    // MoE
    ggml_tensor *gate_inp = nullptr, *up_exps = nullptr, *gate_exps = nullptr, *down_exps = nullptr;
    ggml_tensor *gate_inp_shexp = nullptr, *gate_shexp = nullptr, *up_shexp = nullptr, *down_shexp = nullptr;
};

struct Hparams {
    int n_vocab = 0, n_embd = 0, n_layer = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_rot = 0;
    float rope_base = 10000.f, eps = 1e-6f;
    int n_expert = 0, n_expert_used = 0;
    int conv_k = 4, dk = 0, hk = 0, hv = 0, dv = 0;  // GDN
    int conv_dim() const { return 2 * hk * dk + hv * dv; }
    int block_size = 32, mask_id = -1, eos_id = -1;
    float threshold = 0.95f;
    std::string policy = "threshold";  // clover.policy: the model's default acceptance rule
    int expert_budget = 0;             // clover.expert_budget (0: none)
    std::vector<int> block_sizes;      // clover.block_sizes: the widths it was trained on (block_size "auto")
    std::map<int, double> block_tpf;   // clover.block_tokens_per_forward: width -> the model card's tokens per forward
};

struct GgufFile {
    gguf_context * g = nullptr;
    ggml_context * meta = nullptr;
    ggml_backend_buffer_t buf = nullptr;
};

// A DFlash block drafter (`clover export-gguf DRAFTER_DIR`, arch dflash; clover.models.dflash): a few
// Qwen3-style layers over the target's hidden states, with the target's embedding and LM head.
struct DraftLayer {
    ggml_tensor *attn_norm = nullptr, *ffn_norm = nullptr, *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
    ggml_tensor *q_norm = nullptr, *k_norm = nullptr, *gate = nullptr, *up = nullptr, *down = nullptr;
    ggml_tensor *k_cache = nullptr, *v_cache = nullptr;  // [hd, n_kv_heads, n_ctx]: the context's K/V
};

struct Drafter {
    bool loaded = false;
    GgufFile file;
    int n_embd = 0, n_layer = 0, n_head = 0, n_head_kv = 0, head_dim = 0, block_size = 16, mask_id = -1;
    float eps = 1e-6f, rope_base = 1e6f, embd_scale = 1.f, out_mult = 1.f, softcap = 0.f;
    std::vector<int> target_layers;  // the target layers whose outputs make a context vector, in order
    ggml_tensor *fc = nullptr, *hidden_norm = nullptr, *out_norm = nullptr;
    std::vector<DraftLayer> layers;  // their K/V caches live in the target's cache buffer (reset_cache)
    int n_past = 0;  // context tokens in the cache
    double cpu_s = 0.0;  // process CPU time in drafter forwards (since the request started)
    int n_features() const { return (int) target_layers.size() * n_embd; }
    // the verify widths (anchor + drafts) a confidence cut may choose (DFlashDrafter.verify_widths)
    std::vector<int> verify_widths() const {
        std::vector<int> w;
        for (int x : {4, 8}) if (x < block_size) w.push_back(x);
        w.push_back(block_size);
        return w;
    }
};

// A row: what one request's decoding keeps between forwards. Its cache slot and committed length, its
// GDN states per layer (the conv state [C][K-1]: the last K-1 pre-conv inputs of the prefix; the
// recurrent state [Hv][dk][dv]), its block expert sharing, and how many rows the forwards it took part
// in had (the done line's batch_rows). The unbatched row is the model's own (`Model::row`, slot 0); a
// batched row (--parallel) is its request thread's (`tl_seq`), in a slot of its own.
struct Seq {
    int slot = 0, n_past = 0;
    std::vector<std::vector<float>> conv, S;
    // speculative rollback: per layer the state before the last recorded commit, that commit's inputs
    // per value head [h][t][q dk | k dk | v dv | alpha | beta] (a rollback replays the kept tokens with
    // the same code), and its conv window [C][K-1+Tc]
    std::vector<std::vector<float>> S0, rec, window;
    int rec_T = 0, window_len = 0;
    int share_budget = 0;     // block expert sharing of the request (0: off)
    bool share_max = false;   // rank experts by the max (else the sum) of the block's router probabilities
    long forwards = 0, rows = 0;
};

struct Model {
    Hparams hp;
    Drafter dr;
    GgufFile main_file, side_file;
    std::vector<std::string> pieces;  // each token's bytes, for stop strings
    llama_model * vocab_model = nullptr;  // libllama, vocab_only: the GGUF's tokenizer and chat template
    const llama_vocab * vocab = nullptr;
    bool has_clover = false;
    bool moe_grouped = true;    // routed experts of large forwards by moe_grouped (else ggml_mul_mat_id)
    bool flash_attn = true;     // attention by ggml_flash_attn_ext (else mul_mat, soft_max, mul_mat)
    bool wide = false;          // q8_0 matmuls by the port's wide kernel (--matmul wide)
    bool gdn_fast = true;       // the GDN ops' vector paths (--gdn fast|scalar)
    ggml_type kv_type = GGML_TYPE_F32;
    int n_threads = 1;
    bool exact_verify = true;   // dflash verifies compute each position as an AR step does (--verify exact|batched)
    ggml_tensor *tok_embd = nullptr, *out_norm = nullptr, *output = nullptr;
    std::vector<Layer> layers;
    ggml_backend_t backend = nullptr;
    ggml_context * cache_ctx = nullptr;
    ggml_backend_buffer_t cache_buf = nullptr;
    int n_ctx = 0;   // positions per cache slot
    int n_slots = 1; // cache slots (--parallel): a batched row's K/V live in its slot, [slot * n_ctx, (slot + 1) * n_ctx)
    Seq row;         // the row of unbatched forwards (slot 0)
    double last_forward_s = 0.0;  // wall time of the last forward (graph build + compute)
    double last_forward_cpu_s = 0.0;  // its process CPU time
    ggml_gallocr_t galloc = nullptr;
    std::vector<uint8_t> graph_mem;
};

static int64_t key_id(gguf_context * g, const std::string & k, bool required = true) {
    int64_t id = gguf_find_key(g, k.c_str());
    if (id < 0 && required) die("GGUF key missing: " + k);
    return id;
}

// Each token's bytes, from tokenizer.ggml.tokens: GPT-2 byte-level BPE shows every byte as one
// unicode character (bytes_to_unicode); this inverts that map. Control and user-defined tokens
// are their text as it is. (The stop-string check needs the text; prompts come as token ids.)
static std::vector<std::string> token_pieces(gguf_context * g) {
    std::vector<std::string> out;
    const int64_t tid = gguf_find_key(g, "tokenizer.ggml.tokens");
    if (tid < 0) return out;
    const int64_t yid = gguf_find_key(g, "tokenizer.ggml.token_type");
    const int32_t * types = yid >= 0 ? (const int32_t *) gguf_get_arr_data(g, yid) : nullptr;
    std::map<uint32_t, uint8_t> byte_of;
    for (int b = 0, n = 0; b < 256; b++) {
        const bool shown = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        byte_of[shown ? (uint32_t) b : (uint32_t) (256 + n++)] = (uint8_t) b;
    }
    const size_t n_tok = gguf_get_arr_n(g, tid);
    out.reserve(n_tok);
    for (size_t i = 0; i < n_tok; i++) {
        const std::string s = gguf_get_arr_str(g, tid, i);
        const int type = types ? types[i] : 1;
        if (type != 1) {  // not a normal token: CONTROL / USER_DEFINED / UNUSED text as it is
            out.push_back(s);
            continue;
        }
        std::string bytes;
        for (size_t j = 0; j < s.size();) {  // UTF-8 decode, then the byte each code point stands for
            const unsigned char c = (unsigned char) s[j];
            const int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
            uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
            for (int k = 1; k < len && j + k < s.size(); k++) cp = (cp << 6) | ((unsigned char) s[j + k] & 0x3F);
            const auto it = byte_of.find(cp);
            if (it != byte_of.end()) bytes += (char) it->second;
            else bytes += s.substr(j, len);
            j += len;
        }
        out.push_back(bytes);
    }
    return out;
}

static uint32_t get_u32(gguf_context * g, const std::string & k) {
    int64_t id = key_id(g, k);
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32: return (uint32_t) gguf_get_val_i32(g, id);
        case GGUF_TYPE_UINT64: return (uint32_t) gguf_get_val_u64(g, id);
        default: die("GGUF key " + k + " is not an integer");
    }
    return 0;
}

static float get_f32(gguf_context * g, const std::string & k, float dflt, bool required = true) {
    int64_t id = key_id(g, k, required);
    if (id < 0) return dflt;
    return gguf_get_val_f32(g, id);
}

// The integers of GGUF array key k (id: its key_id)
static std::vector<int> get_ints(gguf_context * g, int64_t id, const std::string & k) {
    const gguf_type t = gguf_get_arr_type(g, id);
    const void * d = gguf_get_arr_data(g, id);
    std::vector<int> out;
    for (size_t i = 0; i < gguf_get_arr_n(g, id); i++) {
        if (t == GGUF_TYPE_INT32) out.push_back(((const int32_t *) d)[i]);
        else if (t == GGUF_TYPE_UINT32) out.push_back((int) ((const uint32_t *) d)[i]);
        else if (t == GGUF_TYPE_INT64) out.push_back((int) ((const int64_t *) d)[i]);
        else if (t == GGUF_TYPE_UINT64) out.push_back((int) ((const uint64_t *) d)[i]);
        else die(k + ": an array of integers expected");
    }
    return out;
}

static GgufFile open_gguf(const std::string & path, ggml_backend_t backend) {
    GgufFile f;
    gguf_init_params p = {/*no_alloc*/ true, /*ctx*/ &f.meta};
    f.g = gguf_init_from_file(path.c_str(), p);
    if (!f.g) die("cannot read GGUF " + path);
    f.buf = ggml_backend_alloc_ctx_tensors(f.meta, backend);
    if (!f.buf) die("cannot allocate the tensors of " + path);
    FILE * fp = fopen(path.c_str(), "rb");
    if (!fp) die("cannot open " + path);
    const size_t data0 = gguf_get_data_offset(f.g);
    std::vector<uint8_t> tmp;
    for (int64_t i = 0; i < gguf_get_n_tensors(f.g); i++) {
        const char * name = gguf_get_tensor_name(f.g, i);
        ggml_tensor * t = ggml_get_tensor(f.meta, name);
        const size_t n = ggml_nbytes(t);
        tmp.resize(n);
        if (fseek(fp, (long) (data0 + gguf_get_tensor_offset(f.g, i)), SEEK_SET) != 0 || fread(tmp.data(), 1, n, fp) != n)
            die(std::string("cannot read tensor ") + name + " of " + path);
        ggml_backend_tensor_set(t, tmp.data(), 0, n);
    }
    fclose(fp);
    return f;
}

static ggml_tensor * find(const GgufFile & f, const std::string & name, bool required = true) {
    ggml_tensor * t = f.meta ? ggml_get_tensor(f.meta, name.c_str()) : nullptr;
    if (!t && required) die("tensor missing: " + name);
    return t;
}

static std::string dir_of(const std::string & p) {
    size_t s = p.find_last_of('/');
    return s == std::string::npos ? std::string(".") : p.substr(0, s);
}

static void load_model(Model & m, const std::string & path, const std::string & sidecar_arg, int n_threads) {
    m.backend = ggml_backend_cpu_init();
    m.n_threads = n_threads;
    ggml_backend_cpu_set_n_threads(m.backend, n_threads);
    if (n_threads > 1) {  // one pool for the whole run, not threads created at every forward (as llama.cpp)
        ggml_threadpool_params tp = ggml_threadpool_params_default(n_threads);
        ggml_backend_cpu_set_threadpool(m.backend, ggml_threadpool_new(&tp));
    }
    m.main_file = open_gguf(path, m.backend);
    gguf_context * g = m.main_file.g;
    m.pieces = token_pieces(g);
    int64_t arch_id = key_id(g, "general.architecture");
    const std::string arch = gguf_get_val_str(g, arch_id);
    if (arch != "qwen35moe") die("architecture " + arch + " is not qwen35moe");
    const std::string a = arch + ".";
    Hparams & hp = m.hp;
    hp.n_embd = (int) get_u32(g, a + "embedding_length");
    hp.n_layer = (int) get_u32(g, a + "block_count");
    hp.n_head = (int) get_u32(g, a + "attention.head_count");
    hp.n_head_kv = (int) get_u32(g, a + "attention.head_count_kv");
    hp.head_dim = (int) get_u32(g, a + "attention.key_length");
    hp.n_rot = (int) get_u32(g, a + "rope.dimension_count");
    hp.rope_base = get_f32(g, a + "rope.freq_base", 10000.f);
    hp.eps = get_f32(g, a + "attention.layer_norm_rms_epsilon", 1e-6f);
    hp.n_expert = (int) get_u32(g, a + "expert_count");
    hp.n_expert_used = (int) get_u32(g, a + "expert_used_count");
    hp.conv_k = (int) get_u32(g, a + "ssm.conv_kernel");
    hp.dk = (int) get_u32(g, a + "ssm.state_size");
    hp.hk = (int) get_u32(g, a + "ssm.group_count");
    hp.hv = (int) get_u32(g, a + "ssm.time_step_rank");
    hp.dv = (int) get_u32(g, a + "ssm.inner_size") / hp.hv;
    if (hp.dv != hp.dk) die("ssm.inner_size / time_step_rank != state_size");
    std::vector<bool> recurrent(hp.n_layer);
    int64_t rid = key_id(g, a + "attention.recurrent_layers", false);
    if (rid >= 0) {
        if ((int) gguf_get_arr_n(g, rid) < hp.n_layer) die("attention.recurrent_layers too short");
        const int8_t * b = (const int8_t *) gguf_get_arr_data(g, rid);
        for (int i = 0; i < hp.n_layer; i++) recurrent[i] = b[i] != 0;
    } else {
        int interval = key_id(g, a + "full_attention_interval", false) >= 0 ? (int) get_u32(g, a + "full_attention_interval") : 4;
        for (int i = 0; i < hp.n_layer; i++) recurrent[i] = (i + 1) % interval != 0;
    }
    int64_t eid = key_id(g, "tokenizer.ggml.eos_token_id", false);
    if (eid >= 0) hp.eos_id = (int) get_u32(g, "tokenizer.ggml.eos_token_id");
    if (key_id(g, "clover.mask_token_id", false) >= 0) hp.mask_id = (int) get_u32(g, "clover.mask_token_id");
    if (key_id(g, "clover.block_size", false) >= 0) hp.block_size = (int) get_u32(g, "clover.block_size");
    hp.threshold = get_f32(g, "clover.threshold", 0.95f, false);
    if (key_id(g, "clover.policy", false) >= 0) hp.policy = gguf_get_val_str(g, key_id(g, "clover.policy"));
    if (key_id(g, "clover.expert_budget", false) >= 0) hp.expert_budget = (int) get_u32(g, "clover.expert_budget");
    if (int64_t bid = key_id(g, "clover.block_sizes", false); bid >= 0) hp.block_sizes = get_ints(g, bid, "clover.block_sizes");
    if (int64_t tid = key_id(g, "clover.block_tokens_per_forward", false); tid >= 0) {
        try {
            const nlohmann::json t = nlohmann::json::parse(gguf_get_val_str(g, tid));
            for (const auto & kv : t.items()) hp.block_tpf[std::stoi(kv.key())] = kv.value().get<double>();
        } catch (const std::exception & e) {
            die(std::string("clover.block_tokens_per_forward: not a JSON object of width -> tokens per forward: ") + e.what());
        }
    }

    // Clover's tensors: inline, or in the sidecar named by clover.tensors_file
    std::string side = sidecar_arg;
    int64_t tf = key_id(g, "clover.tensors_file", false);
    if (side.empty() && tf >= 0) side = dir_of(path) + "/" + gguf_get_val_str(g, tf);
    if (!side.empty()) {
        FILE * t = fopen(side.c_str(), "rb");
        if (t) {
            fclose(t);
            m.side_file = open_gguf(side, m.backend);
        } else if (!sidecar_arg.empty()) {
            die("cannot open sidecar " + side);
        }
    }
    auto any = [&](const std::string & name) -> ggml_tensor * {
        ggml_tensor * t = find(m.main_file, name, false);
        return t ? t : find(m.side_file, name, false);
    };

    m.tok_embd = find(m.main_file, "token_embd.weight");
    m.out_norm = find(m.main_file, "output_norm.weight");
    m.output = find(m.main_file, "output.weight", false);
    if (!m.output) m.output = m.tok_embd;
    hp.n_vocab = (int) m.tok_embd->ne[1];
    m.layers.resize(hp.n_layer);
    m.has_clover = true;
    for (int i = 0; i < hp.n_layer; i++) {
        Layer & L = m.layers[i];
        auto t = [&](const std::string & s) { return find(m.main_file, "blk." + std::to_string(i) + "." + s); };
        L.recurrent = recurrent[i];
        L.attn_norm = t("attn_norm.weight");
        L.post_norm = t("post_attention_norm.weight");
        if (L.recurrent) {
            L.wqkv = t("attn_qkv.weight");
            L.wgate = t("attn_gate.weight");
            L.conv1d = t("ssm_conv1d.weight");
            L.dt = t("ssm_dt.bias");
            L.ssm_a = t("ssm_a");
            L.wbeta = t("ssm_beta.weight");
            L.walpha = t("ssm_alpha.weight");
            L.ssm_norm = t("ssm_norm.weight");
            L.ssm_out = t("ssm_out.weight");
            const std::string p = "blk." + std::to_string(i) + ".";
            L.conv_right = any(p + "clover_conv1d_right.weight");
            L.intra_scale = any(p + "clover_intra_scale");
            L.gain_a = any(p + "clover_block_gain_a");
            L.gain_b = any(p + "clover_block_gain_b");
            if (!L.conv_right || !L.intra_scale || !L.gain_a || !L.gain_b) m.has_clover = false;
            for (ggml_tensor * x : {L.conv1d, L.dt, L.ssm_a, L.conv_right, L.intra_scale, L.gain_a, L.gain_b})
                if (x && x->type != GGML_TYPE_F32) die(std::string(x->name) + " must be f32");
        } else {
            L.wq = t("attn_q.weight");
            L.wk = t("attn_k.weight");
            L.wv = t("attn_v.weight");
            L.wo = t("attn_output.weight");
            L.q_norm = t("attn_q_norm.weight");
            L.k_norm = t("attn_k_norm.weight");
        }
        L.gate_inp = t("ffn_gate_inp.weight");
        L.up_exps = t("ffn_up_exps.weight");
        L.gate_exps = t("ffn_gate_exps.weight");
        L.down_exps = t("ffn_down_exps.weight");
        L.gate_inp_shexp = t("ffn_gate_inp_shexp.weight");
        L.gate_shexp = t("ffn_gate_shexp.weight");
        L.up_shexp = t("ffn_up_shexp.weight");
        L.down_shexp = t("ffn_down_shexp.weight");
    }
    m.galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(m.backend));
}

// --drafter FILE: a DFlash drafter GGUF, checked against the target it drafts for (one-line errors,
// as clover's DFlashConfig.check_target).
static void load_drafter(Model & m, const std::string & path) {
    Drafter & d = m.dr;
    const Hparams & hp = m.hp;
    auto bad = [&](const std::string & why) { die("--drafter " + path + ": " + why); };
    FILE * fp = fopen(path.c_str(), "rb");
    if (!fp) bad("cannot open the file");
    char magic[4] = {0, 0, 0, 0};
    const size_t got = fread(magic, 1, 4, fp);
    fclose(fp);
    if (got != 4 || memcmp(magic, "GGUF", 4) != 0)
        bad("not a GGUF file; export the drafter with `clover export-gguf DRAFTER_DIR FILE`");
    d.file = open_gguf(path, m.backend);
    gguf_context * g = d.file.g;
    const int64_t arch_id = gguf_find_key(g, "general.architecture");
    const std::string arch = arch_id >= 0 ? gguf_get_val_str(g, arch_id) : "(none)";
    if (arch != "dflash")
        bad("architecture " + arch + " is not a DFlash drafter (dflash); export one with `clover export-gguf DRAFTER_DIR FILE`");
    auto u32 = [&](const std::string & k) -> int {
        if (gguf_find_key(g, ("dflash." + k).c_str()) < 0) bad("key dflash." + k + " missing");
        return (int) get_u32(g, "dflash." + k);
    };
    d.n_embd = u32("embedding_length");
    d.n_layer = u32("block_count");
    d.n_head = u32("attention.head_count");
    d.n_head_kv = u32("attention.head_count_kv");
    d.head_dim = u32("attention.key_length");
    d.block_size = u32("block_size");
    d.mask_id = u32("mask_token_id");
    const int vocab = u32("vocab_size");
    d.eps = get_f32(g, "dflash.attention.layer_norm_rms_epsilon", 1e-6f, false);
    d.rope_base = get_f32(g, "dflash.rope.freq_base", 1e6f, false);
    d.embd_scale = get_f32(g, "dflash.input_embedding_scale", 1.f, false);
    d.out_mult = get_f32(g, "dflash.output_multiplier", 1.f, false);
    d.softcap = get_f32(g, "dflash.final_logit_softcapping", 0.f, false);
    const int64_t tid = gguf_find_key(g, "dflash.target_layer_ids");
    if (tid < 0) bad("key dflash.target_layer_ids missing");
    d.target_layers = get_ints(g, tid, "dflash.target_layer_ids");
    const std::string another = "; this drafter was trained for another model";
    if (d.n_embd != hp.n_embd)
        bad("drafter: hidden_size " + std::to_string(d.n_embd) + " != the target's " + std::to_string(hp.n_embd) + another);
    if (vocab != hp.n_vocab)
        bad("drafter: vocab_size " + std::to_string(vocab) + " != the target's " + std::to_string(hp.n_vocab) + another);
    if (d.target_layers.empty()) bad("drafter: target_layer_ids is empty");
    for (int i : d.target_layers)
        if (i < 0 || i >= hp.n_layer)
            bad("drafter: target_layer_ids name layer " + std::to_string(i) + ", but the target has " + std::to_string(hp.n_layer) + " layers" + another);
    if (gguf_find_key(g, "dflash.num_target_layers") >= 0 && u32("num_target_layers") != hp.n_layer)
        bad("drafter: num_target_layers " + std::to_string(u32("num_target_layers")) + " != the target's " + std::to_string(hp.n_layer) + " layers" + another);
    if (d.mask_id < 0 || d.mask_id >= hp.n_vocab)
        bad("drafter: mask_token_id " + std::to_string(d.mask_id) + " is outside the target's vocabulary (" + std::to_string(hp.n_vocab) + ")");
    if (d.block_size < 2) bad("drafter: block_size " + std::to_string(d.block_size) + " must be >= 2");
    if (d.n_head_kv <= 0 || d.n_head % d.n_head_kv != 0) bad("drafter: head_count must be a multiple of head_count_kv");
    auto t = [&](const std::string & name, int64_t ne0, int64_t ne1) {
        ggml_tensor * x = find(d.file, name, false);
        if (!x) bad("tensor " + name + " missing");
        if (x->ne[0] != ne0 || x->ne[1] != ne1 || x->ne[2] != 1)
            bad("tensor " + name + " is [" + std::to_string(x->ne[0]) + ", " + std::to_string(x->ne[1]) + "], expected [" +
                std::to_string(ne0) + ", " + std::to_string(ne1) + "]");
        return x;
    };
    const int H = d.n_embd, hd = d.head_dim;
    d.fc = t("fc.weight", d.n_features(), H);
    d.hidden_norm = t("hidden_norm.weight", H, 1);
    d.out_norm = t("output_norm.weight", H, 1);
    d.layers.resize(d.n_layer);
    for (int i = 0; i < d.n_layer; i++) {
        DraftLayer & L = d.layers[i];
        const std::string b = "blk." + std::to_string(i) + ".";
        const ggml_tensor * ff = find(d.file, b + "ffn_gate.weight", false);
        const int64_t I = ff ? ff->ne[1] : 0;
        L.attn_norm = t(b + "attn_norm.weight", H, 1);
        L.ffn_norm = t(b + "ffn_norm.weight", H, 1);
        L.wq = t(b + "attn_q.weight", H, (int64_t) d.n_head * hd);
        L.wk = t(b + "attn_k.weight", H, (int64_t) d.n_head_kv * hd);
        L.wv = t(b + "attn_v.weight", H, (int64_t) d.n_head_kv * hd);
        L.wo = t(b + "attn_output.weight", (int64_t) d.n_head * hd, H);
        L.q_norm = t(b + "attn_q_norm.weight", hd, 1);
        L.k_norm = t(b + "attn_k_norm.weight", hd, 1);
        L.gate = t(b + "ffn_gate.weight", H, I);
        L.up = t(b + "ffn_up.weight", H, I);
        L.down = t(b + "ffn_down.weight", I, H);
    }
    d.loaded = true;
}

static const int KV_PAD = 256;  // the cache's capacity and the key length a graph reads: multiples of this
static void clear_graphs();

// A row emptied: nothing committed, zero GDN states (its slot and expert sharing kept).
static void seq_clear(const Model & m, Seq & q) {
    const Hparams & hp = m.hp;
    q.n_past = 0;
    q.forwards = q.rows = 0;
    q.conv.assign(hp.n_layer, {});
    q.S.assign(hp.n_layer, {});
    q.S0.assign(hp.n_layer, {});
    q.rec.assign(hp.n_layer, {});
    q.window.assign(hp.n_layer, {});
    q.rec_T = q.window_len = 0;
    for (int il = 0; il < hp.n_layer; il++) {
        if (!m.layers[il].recurrent) continue;
        q.conv[il].assign((size_t) hp.conv_dim() * (hp.conv_k - 1), 0.f);
        q.S[il].assign((size_t) hp.hv * hp.dk * hp.dv, 0.f);
    }
}

// (Re)creates an empty cache for n_ctx positions (per slot), and empties the model's row.
static void reset_cache(Model & m, int n_ctx) {
    const Hparams & hp = m.hp;
    n_ctx = (n_ctx + KV_PAD - 1) / KV_PAD * KV_PAD;
    if (m.cache_ctx == nullptr || n_ctx > m.n_ctx) {
        clear_graphs();  // their views point into the old cache
        if (m.cache_buf) ggml_backend_buffer_free(m.cache_buf);
        if (m.cache_ctx) ggml_free(m.cache_ctx);
        ggml_init_params p = {ggml_tensor_overhead() * (2 * hp.n_layer + 2 * m.dr.n_layer + 4), nullptr, true};
        m.cache_ctx = ggml_init(p);
        for (Layer & L : m.layers) {
            if (L.recurrent) continue;
            L.k_cache = ggml_new_tensor_3d(m.cache_ctx, m.kv_type, hp.head_dim, hp.n_head_kv, (int64_t) n_ctx * m.n_slots);
            L.v_cache = ggml_new_tensor_3d(m.cache_ctx, m.kv_type, hp.head_dim, hp.n_head_kv, (int64_t) n_ctx * m.n_slots);
        }
        for (DraftLayer & L : m.dr.layers) {  // the drafter's context K/V, as long as the target's cache
            L.k_cache = ggml_new_tensor_3d(m.cache_ctx, m.kv_type, m.dr.head_dim, m.dr.n_head_kv, n_ctx);
            L.v_cache = ggml_new_tensor_3d(m.cache_ctx, m.kv_type, m.dr.head_dim, m.dr.n_head_kv, n_ctx);
        }
        m.cache_buf = ggml_backend_alloc_ctx_tensors(m.cache_ctx, m.backend);
        m.n_ctx = n_ctx;
    }
    ggml_backend_buffer_clear(m.cache_buf, 0);
    seq_clear(m, m.row);
    m.dr.n_past = 0;
    m.dr.cpu_s = 0.0;
}

// Every slot grown to n_ctx positions, keeping what the slots hold (the batched rows in flight).
static void grow_cache(Model & m, int n_ctx) {
    n_ctx = (n_ctx + KV_PAD - 1) / KV_PAD * KV_PAD;
    if (m.cache_ctx != nullptr && n_ctx <= m.n_ctx) return;
    std::vector<std::vector<uint8_t>> old;
    const int old_ctx = m.cache_ctx ? m.n_ctx : 0;
    for (Layer & L : m.layers) {
        if (L.recurrent || !old_ctx) continue;
        for (ggml_tensor * t : {L.k_cache, L.v_cache}) {
            old.emplace_back(ggml_nbytes(t));
            ggml_backend_tensor_get(t, old.back().data(), 0, old.back().size());
        }
    }
    reset_cache(m, n_ctx);
    size_t i = 0;
    for (Layer & L : m.layers) {
        if (L.recurrent || !old_ctx) continue;
        for (ggml_tensor * t : {L.k_cache, L.v_cache}) {
            const size_t per = t->nb[2] * (size_t) old_ctx;  // one slot's bytes before
            for (int s = 0; s < m.n_slots; s++)
                ggml_backend_tensor_set(t, old[i].data() + per * s, t->nb[2] * (size_t) m.n_ctx * s, per);
            i++;
        }
    }
}

// A new batched row in its slot (q.slot), for n_ctx positions: empty GDN states.
static void seq_start(Model & m, Seq & q, int n_ctx) {
    grow_cache(m, n_ctx);
    seq_clear(m, q);
}

// ------------------------------------------------------------------------------------- text
// The GGUF's own tokenizer and chat template, through llama.cpp's vocab API (libllama loads the
// file with vocab_only: the tokenizer and metadata, no weights).
static void load_vocab(Model & m, const std::string & path) {
    llama_log_set([](ggml_log_level level, const char * text, void *) { if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr); }, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    mp.progress_callback = [](float, void *) { return true; };
    m.vocab_model = llama_model_load_from_file(path.c_str(), mp);
    if (m.vocab_model) m.vocab = llama_model_get_vocab(m.vocab_model);
}

static const llama_vocab * need_vocab(const Model & m) {
    if (!m.vocab) throw std::runtime_error("text needs the GGUF's tokenizer, which llama.cpp could not load; send token ids");
    return m.vocab;
}

// text -> ids as clover's tokenizer: no BOS, special tokens written in the text are parsed (parse_special)
static std::vector<int> tokenize(const Model & m, const std::string & text, bool parse_special = true) {
    const llama_vocab * v = need_vocab(m);
    if (text.empty()) return {};
    int n = -llama_tokenize(v, text.data(), (int) text.size(), nullptr, 0, false, parse_special);
    std::vector<llama_token> ids(std::max(n, 0));
    if (n > 0 && llama_tokenize(v, text.data(), (int) text.size(), ids.data(), n, false, parse_special) != n)
        throw std::runtime_error("llama_tokenize failed");
    return std::vector<int>(ids.begin(), ids.end());
}

// ids -> text as clover's tokenizer.decode: special tokens shown as their text, no clean-up
static std::string detokenize(const Model & m, const std::vector<int> & ids) {
    if (!m.vocab) {  // no libllama vocab: the byte-level pieces
        std::string s;
        for (int t : ids) if (t >= 0 && t < (int) m.pieces.size()) s += m.pieces[t];
        return s;
    }
    if (ids.empty()) return "";
    std::vector<llama_token> t(ids.begin(), ids.end());
    std::string out(ids.size() * 8 + 16, '\0');
    int n = llama_detokenize(m.vocab, t.data(), (int) t.size(), out.data(), (int) out.size(), false, true);
    if (n < 0) {
        out.resize(-n);
        n = llama_detokenize(m.vocab, t.data(), (int) t.size(), out.data(), (int) out.size(), false, true);
    }
    out.resize(std::max(n, 0));
    return out;
}

static std::string utf8_of(uint32_t cp) {
    std::string s;
    if (cp < 0x80) s += (char) cp;
    else if (cp < 0x800) { s += (char) (0xC0 | (cp >> 6)); s += (char) (0x80 | (cp & 0x3F)); }
    else { s += (char) (0xE0 | (cp >> 12)); s += (char) (0x80 | ((cp >> 6) & 0x3F)); s += (char) (0x80 | (cp & 0x3F)); }
    return s;
}

static void replace_all(std::string & s, const std::string & a, const std::string & b) {
    for (size_t i = s.find(a); i != std::string::npos; i = s.find(a, i + b.size())) s.replace(i, a.size(), b);
}

// A chat as token ids, with the GGUF's chat template (llama_chat_apply_template: llama.cpp's built-in
// templates, detected from the GGUF's tokenizer.chat_template). As clover's Tokenizer.apply_chat_template:
// control tokens written in message content are encoded as text, only the template writes control
// tokens (content is rendered with private-use placeholders for them; the rendered text is split at the
// control tokens the template wrote, each piece encoded with special tokens read as text).
static std::vector<int> chat_prompt(const Model & m, const nlohmann::json & messages, bool add_generation_prompt) {
    const llama_vocab * v = need_vocab(m);
    const char * tmpl = llama_model_chat_template(m.vocab_model, nullptr);
    if (!tmpl) throw std::runtime_error("messages: this model's GGUF has no chat template; use a plain prompt instead");
    if (!messages.is_array() || messages.empty()) throw std::runtime_error("messages: must be a non-empty list of {role, content}");
    std::vector<std::string> specials;
    for (int t = 0; t < llama_vocab_n_tokens(v); t++)
        if (llama_vocab_get_attr(v, t) & LLAMA_TOKEN_ATTR_CONTROL) {
            const std::string s = llama_vocab_get_text(v, t);
            if (!s.empty()) specials.push_back(s);
        }
    std::sort(specials.begin(), specials.end(), [](const std::string & a, const std::string & b) { return a.size() > b.size(); });
    std::string used;
    std::vector<std::string> roles, contents;
    for (const auto & msg : messages) {
        if (!msg.is_object() || !msg.contains("role") || !msg["role"].is_string() || !msg.contains("content") || !msg["content"].is_string())
            throw std::runtime_error("messages: each message needs a string role and a string content");
        roles.push_back(msg["role"]);
        contents.push_back(msg["content"]);
        used += roles.back() + contents.back();
    }
    uint32_t lead = 0xE000;
    while (used.find(utf8_of(lead)) != std::string::npos) lead++;
    std::vector<std::string> marks;
    for (size_t i = 0; i < specials.size(); i++) marks.push_back(utf8_of(lead) + utf8_of(0xF000 + (uint32_t) i));
    std::vector<llama_chat_message> chat;
    for (size_t i = 0; i < contents.size(); i++) {
        for (size_t k = 0; k < specials.size(); k++) replace_all(contents[i], specials[k], marks[k]);
        chat.push_back({roles[i].c_str(), contents[i].c_str()});
    }
    std::vector<char> buf(1024 + 2 * used.size() * 4);
    int n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_generation_prompt, buf.data(), (int) buf.size());
    if (n > (int) buf.size()) {
        buf.resize(n);
        n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_generation_prompt, buf.data(), (int) buf.size());
    }
    if (n < 0) throw std::runtime_error("messages: llama.cpp does not know this GGUF's chat template (llama_chat_apply_template); send a plain prompt");
    const std::string text(buf.data(), n);
    std::vector<int> ids;
    size_t pos = 0;
    while (pos <= text.size()) {
        size_t best = std::string::npos, blen = 0;  // the next control token the template wrote
        for (const std::string & s : specials) {
            const size_t f = text.find(s, pos);
            if (f != std::string::npos && (f < best || (f == best && s.size() > blen))) { best = f; blen = s.size(); }
        }
        std::string piece = text.substr(pos, best == std::string::npos ? std::string::npos : best - pos);
        if (!piece.empty()) {
            for (size_t k = 0; k < specials.size(); k++) replace_all(piece, marks[k], specials[k]);
            for (int t : tokenize(m, piece, false)) ids.push_back(t);
        }
        if (best == std::string::npos) break;
        ids.push_back(tokenize(m, text.substr(best, blen), true).at(0));
        pos = best + blen;
    }
    return ids;
}

// How much of `text` a stream may emit now (clover's base.held_back, on bytes): not a trailing
// incomplete UTF-8 sequence, nor a tail that could be the start of a stop string.
static size_t held_back(const std::string & text, const std::vector<std::string> & stop) {
    size_t n = text.size();
    for (size_t back = 1; back <= 4 && back <= n; back++) {  // a lead byte whose sequence is not complete
        const unsigned char c = (unsigned char) text[n - back];
        if ((c & 0xC0) == 0x80) continue;
        const size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
        if (len > back) n -= back;
        break;
    }
    size_t cut = n;
    for (const std::string & s : stop)
        for (size_t k = std::min(s.size() - 1, n); k > 0; k--)
            if (text.compare(n - k, k, s, 0, k) == 0) { cut = std::min(cut, n - k); break; }
    return cut;
}

// A finished row's text with its first stop string and what follows removed (base.trim_at_stop)
static std::string trim_at_stop(const std::string & text, const std::vector<std::string> & stop) {
    size_t end = text.size();
    for (const std::string & s : stop) {
        const size_t f = text.find(s);
        if (f != std::string::npos) end = std::min(end, f);
    }
    return text.substr(0, end);
}

// ------------------------------------------------------------------------------ the GDN custom ops
// Two ops per GDN layer, with ggml's SiLU between them:
//   gdn_conv: src[0] mixed [C, T] (pre-conv q|k|v) -> pre-activation [C, T]. Columns [0, Tc): the causal
//             depthwise conv over the prefix conv state, which then advances; columns [Tc, T): the
//             denoise block, causal conv over the (advanced) state plus Clover's right-side branch
//             over later block positions. Parallel over channels.
//   gdn_mix:  src[0] act [C, T] (after SiLU), src[1] alpha [Hv, T] (before dt bias), src[2] beta [Hv, T]
//             (before sigmoid) -> o [dv, Hv, T]. Columns [0, Tc): the gated delta rule, advancing S;
//             columns [Tc, T): exp(g_i) S^T q_i + lambda_h(B) sum_j softmax_j(s_h qhat_i.khat_j) v_j
//             against the advanced S (read only). Parallel over value heads.
// Value head h reads key head h % Hk (the GGUF's tiled head order, docs/gguf.md).
// Two implementations (--gdn): scalar (each channel's conv and each reduction in one running sum) and
// fast (the default: the conv over channels in vector rows, each channel's terms summed in the same
// order; the l2norm and q.k reductions in 16 lane sums added pairwise). The two round differently at
// the level of float epsilon (the reductions' order; the compiler's multiply-add contraction of the
// conv's right branch): one f32 forward's logits within 1e-5 of each other.
// One row's columns of a forward and that row's GDN state (its Seq's, for this layer: the model's row,
// or each row of a batched forward; row_columns). window, S0 and rec (a recording forward's, read by a
// speculative rollback) are null where not kept.
struct GdnSeg {
    int col0, Tc, Bd;
    float * conv_state;  // [C][K-1]
    float * S;           // [Hv][dk][dv]
    float * window;      // [C][K-1+Tc] or null
    float * S0, * rec;   // or null
};

struct GdnCall {
    Model * m;
    Layer * L;
    std::vector<GdnSeg> segs;  // set before each compute
};

static inline float softplus_t(float x) { return x > 20.f ? x : log1pf(expf(x)); }  // torch's threshold 20
static inline float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

static float dot_scalar(const float * a, const float * b, int n) {
    float s = 0.f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static float dot_lanes(const float * a, const float * b, int n) {  // 16 lane sums, added pairwise
    float acc[16] = {};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    float tail = 0.f;
    for (; i < n; i++) tail += a[i] * b[i];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0] + tail;
}

static float gdn_dot(bool fast, const float * a, const float * b, int n) { return fast ? dot_lanes(a, b, n) : dot_scalar(a, b, n); }

static void l2norm_inplace(bool fast, float * x, int n) {  // x * rsqrt(sum(x^2) + 1e-6), clover's l2norm
    const float r = 1.f / sqrtf(gdn_dot(fast, x, x, n) + 1e-6f);
    for (int i = 0; i < n; i++) x[i] *= r;
}

// What both gdn_conv paths read: the row's conv state and rollback window, the sizes (C channels,
// kernel K, Tc commit and Bd block columns, the window W = K-1 + Tc), the weights w [C][K] and the
// right branch wr [C][K-1] (or null), the input X and output Y with their column strides in floats.
// One segment's (row's) view: its conv state and window (or null), the sizes, its columns of X and Y.
struct ConvArgs {
    float * state, * window;
    int C, K, K1, Tc, Bd, W;
    const float * w, * wr;
    size_t mnb, dnb;
    const float * X;
    float * Y;
};

static ConvArgs conv_args(ggml_tensor * dst, const GdnCall & c, const GdnSeg & s) {
    const Hparams & hp = c.m->hp;
    const Layer & L = *c.L;
    const ggml_tensor * mixed = dst->src[0];
    const int K = hp.conv_k;
    const size_t mnb = mixed->nb[1] / sizeof(float), dnb = dst->nb[1] / sizeof(float);
    return {s.conv_state, s.window, hp.conv_dim(), K, K - 1, s.Tc, s.Bd, K - 1 + s.Tc, (const float *) L.conv1d->data,
            L.conv_right ? (const float *) L.conv_right->data : nullptr, mnb, dnb,
            (const float *) mixed->data + (size_t) s.col0 * mnb, (float *) dst->data + (size_t) s.col0 * dnb};
}

static void gdn_conv_seg(const ConvArgs & a, int ith, int nth);
static void gdn_conv_fast_seg(const ConvArgs & a, int ith, int nth);

static void gdn_conv(ggml_tensor * dst, int ith, int nth, void * ud) {
    const GdnCall & c = *(const GdnCall *) ud;
    for (const GdnSeg & s : c.segs) gdn_conv_seg(conv_args(dst, c, s), ith, nth);
}

static void gdn_conv_fast(ggml_tensor * dst, int ith, int nth, void * ud) {
    const GdnCall & c = *(const GdnCall *) ud;
    for (const GdnSeg & s : c.segs) gdn_conv_fast_seg(conv_args(dst, c, s), ith, nth);
}

static void gdn_conv_seg(const ConvArgs & a, int ith, int nth) {
    const auto [state, window, C, K, K1, Tc, Bd, W, w, wr, mnb, dnb, X, Y] = a;
    std::vector<float> win(K1 + std::max(Tc, Bd) + K1);
    const int c0 = (int) ((int64_t) C * ith / nth), c1 = (int) ((int64_t) C * (ith + 1) / nth);
    for (int ch = c0; ch < c1; ch++) {
        float * st = &state[(size_t) ch * K1];
        const float * wc = &w[(size_t) ch * K];
        if (Tc) {
            thread_local std::vector<float> own;  // the window, kept for a speculative rollback where asked
            if (!window) own.resize(W);
            float * wn = window ? &window[(size_t) ch * W] : own.data();
            for (int j = 0; j < K1; j++) wn[j] = st[j];
            for (int t = 0; t < Tc; t++) wn[K1 + t] = X[(size_t) t * mnb + ch];
            for (int t = 0; t < Tc; t++) {
                float s = wn[t] * wc[0];
                for (int j = 1; j < K; j++) s += wn[t + j] * wc[j];
                Y[(size_t) t * dnb + ch] = s;
            }
            for (int j = 0; j < K1; j++) st[j] = wn[Tc + j];
        }
        if (Bd) {
            for (int j = 0; j < K1; j++) win[j] = st[j];
            for (int t = 0; t < Bd; t++) win[K1 + t] = X[(size_t) (Tc + t) * mnb + ch];
            const float * wrc = &wr[(size_t) ch * K1];
            for (int t = 0; t < Bd; t++) {
                float s = win[t] * wc[0];
                for (int j = 1; j < K; j++) s += win[t + j] * wc[j];
                float r = 0.f;  // right branch: x_{t+1} .. x_{t+K-1}, zero past the block end
                bool any = false;
                for (int j = 0; j < K1; j++) {
                    if (t + 1 + j < Bd) {
                        r = any ? r + win[K1 + t + 1 + j] * wrc[j] : win[K1 + t + 1 + j] * wrc[j];
                        any = true;
                    }
                }
                Y[(size_t) (Tc + t) * dnb + ch] = s + r;
            }
        }
    }
}

// gdn_conv with the channels in the inner loops: the rows of the window (the conv state's K-1 rows,
// transposed, then the columns of `mixed`) and of the weights, transposed, read as vectors of this
// task's channels; each output is summed in the scalar path's order.
static void gdn_conv_fast_seg(const ConvArgs & a, int ith, int nth) {
    const auto [state, window, C, K, K1, Tc, Bd, W, w, wr, mnb, dnb, X, Y] = a;
    const int nb = (C + 15) / 16;  // channels split in whole vectors of 16
    const int c0 = 16 * (int) ((int64_t) nb * ith / nth), c1 = std::min(C, 16 * (int) ((int64_t) nb * (ith + 1) / nth));
    const int n = c1 - c0;
    if (n <= 0) return;
    thread_local std::vector<float> buf;
    buf.resize((size_t) n * (K + K1 + 2 * K1 + 1));
    float * wT = buf.data(), * wrT = wT + (size_t) n * K, * st = wrT + (size_t) n * K1, * st2 = st + (size_t) n * K1, * r = st2 + (size_t) n * K1;
    for (int ch = 0; ch < n; ch++) {
        for (int j = 0; j < K; j++) wT[(size_t) j * n + ch] = w[(size_t) (c0 + ch) * K + j];
        if (wr)
            for (int j = 0; j < K1; j++) wrT[(size_t) j * n + ch] = wr[(size_t) (c0 + ch) * K1 + j];
        for (int j = 0; j < K1; j++) st[(size_t) j * n + ch] = state[(size_t) (c0 + ch) * K1 + j];
    }
    // window row p: the state's row p below K1, else the input column t0 + p - K1
    // (the structured bindings are copied into the lambdas: C++17 lets a lambda name them no other way)
    auto row = [&, K1 = K1, X = X, mnb = mnb](int t0, int p) -> const float * { return p < K1 ? st + (size_t) p * n : X + (size_t) (t0 + p - K1) * mnb + c0; };
    auto conv = [&, K = K](int t0, int t, float * y) {  // y = sum_j window[t + j] * w[j], in j order
        const float * x0 = row(t0, t), * w0 = wT;
        for (int ch = 0; ch < n; ch++) y[ch] = x0[ch] * w0[ch];
        for (int j = 1; j < K; j++) {
            const float * xj = row(t0, t + j), * wj = wT + (size_t) j * n;
            for (int ch = 0; ch < n; ch++) y[ch] += xj[ch] * wj[ch];
        }
    };
    if (Tc) {
        for (int t = 0; t < Tc; t++) conv(0, t, Y + (size_t) t * dnb + c0);
        for (int p = 0; p < W && window; p++) {  // the window, kept for a speculative rollback
            const float * x = row(0, p);
            for (int ch = 0; ch < n; ch++) window[(size_t) (c0 + ch) * W + p] = x[ch];
        }
        for (int j = 0; j < K1; j++) std::copy_n(row(0, Tc + j), n, st2 + (size_t) j * n);
        std::copy_n(st2, (size_t) n * K1, st);
        for (int ch = 0; ch < n; ch++)
            for (int j = 0; j < K1; j++) state[(size_t) (c0 + ch) * K1 + j] = st[(size_t) j * n + ch];
    }
    if (Bd) {
        for (int t = 0; t < Bd; t++) {
            float * y = Y + (size_t) (Tc + t) * dnb + c0;
            conv(Tc, t, y);
            const int nr = std::min(K1, Bd - 1 - t);  // right branch: x_{t+1} .. x_{t+K-1}, zero past the block end
            if (nr <= 0) continue;
            const float * x1 = X + (size_t) (Tc + t + 1) * mnb + c0;
            for (int ch = 0; ch < n; ch++) r[ch] = x1[ch] * wrT[ch];
            for (int j = 1; j < nr; j++) {
                const float * xj = X + (size_t) (Tc + t + 1 + j) * mnb + c0, * wj = wrT + (size_t) j * n;
                for (int ch = 0; ch < n; ch++) r[ch] += xj[ch] * wj[ch];
            }
            for (int ch = 0; ch < n; ch++) y[ch] += r[ch];
        }
    }
}

// One token of the gated delta rule for value head h: x = its act row ([q|k|v] after SiLU; q, k of
// key head h % Hk), al/be the raw alpha/beta. S <- S exp(g); S <- S + k (beta (v - S^T k))^T; o = S^T q.
static void commit_step(bool fast, const Hparams & hp, const Layer & L, int h, float * S, const float * qraw, const float * kraw,
                        const float * v, float al, float be, float * o, float * q, float * k, float * kv) {
    const int dk = hp.dk, dv = hp.dv;
    const float * A = (const float *) L.ssm_a->data;  // -exp(A_log)
    const float * dtb = (const float *) L.dt->data;
    std::copy(qraw, qraw + dk, q);
    std::copy(kraw, kraw + dk, k);
    l2norm_inplace(fast, q, dk);
    l2norm_inplace(fast, k, dk);
    const float qscale = 1.f / sqrtf((float) dk);
    for (int i = 0; i < dk; i++) q[i] *= qscale;
    const float decay = expf(A[h] * softplus_t(al + dtb[h]));
    const float b = sigmoid_f(be);
    std::fill(kv, kv + dv, 0.f);
    for (int i = 0; i < dk; i++) {
        float * row = S + (size_t) i * dv;
        const float ki = k[i];
        for (int j = 0; j < dv; j++) {
            row[j] *= decay;
            kv[j] += row[j] * ki;
        }
    }
    for (int j = 0; j < dv; j++) kv[j] = b * (v[j] - kv[j]);  // delta
    if (o) std::fill(o, o + dv, 0.f);
    for (int i = 0; i < dk; i++) {
        float * row = S + (size_t) i * dv;
        const float ki = k[i], qi = q[i];
        for (int j = 0; j < dv; j++) row[j] += ki * kv[j];
        if (o)
            for (int j = 0; j < dv; j++) o[j] += row[j] * qi;
    }
}

#if defined(__AVX512F__)
// The fast path's commit of Tc tokens for one value head, commit_step's arithmetic element for element
// (the same multiplies and multiply-adds in the same order), the state swept by columns of 16: each
// column block's kv, delta and o stay in registers over the rows, and one sweep applies token t's
// update and readout and token t+1's decay and S^T k. Needs dv % 16 == 0.
// qn, kn: the tokens' normalised q (scaled) and k [Tc][dk]; dec, bt: decay and beta; V: v of token t
// at V + t * vnb; O: o of token t at O + t * onb.
static void commit_tokens_avx512(float * S, int dk, int dv, int Tc, const float * qn, const float * kn, const float * dec,
                                 const float * bt, const float * V, size_t vnb, float * O, size_t onb) {
    for (int j0 = 0; j0 < dv; j0 += 16) {
        float * col = S + j0;
        __m512 kv = _mm512_setzero_ps();
        const __m512 d0 = _mm512_set1_ps(dec[0]);
        for (int i = 0; i < dk; i++) {
            __m512 r = _mm512_mul_ps(_mm512_loadu_ps(col + (size_t) i * dv), d0);
            _mm512_storeu_ps(col + (size_t) i * dv, r);
            kv = _mm512_fmadd_ps(r, _mm512_set1_ps(kn[i]), kv);
        }
        for (int t = 0; t < Tc; t++) {
            const float * k = kn + (size_t) t * dk, * q = qn + (size_t) t * dk;
            const __m512 delta = _mm512_mul_ps(_mm512_set1_ps(bt[t]), _mm512_sub_ps(_mm512_loadu_ps(V + t * vnb + j0), kv));
            __m512 o = _mm512_setzero_ps(), kvn = _mm512_setzero_ps();
            if (t + 1 < Tc) {
                const float * k1 = kn + (size_t) (t + 1) * dk;
                const __m512 d1 = _mm512_set1_ps(dec[t + 1]);
                for (int i = 0; i < dk; i++) {
                    __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(k[i]), delta, _mm512_loadu_ps(col + (size_t) i * dv));
                    o = _mm512_fmadd_ps(r, _mm512_set1_ps(q[i]), o);
                    r = _mm512_mul_ps(r, d1);
                    _mm512_storeu_ps(col + (size_t) i * dv, r);
                    kvn = _mm512_fmadd_ps(r, _mm512_set1_ps(k1[i]), kvn);
                }
            } else {
                for (int i = 0; i < dk; i++) {
                    const __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(k[i]), delta, _mm512_loadu_ps(col + (size_t) i * dv));
                    _mm512_storeu_ps(col + (size_t) i * dv, r);
                    o = _mm512_fmadd_ps(r, _mm512_set1_ps(q[i]), o);
                }
            }
            _mm512_storeu_ps(O + t * onb + j0, o);
            kv = kvn;
        }
    }
}

// The denoise readout of the fast path: o_t = decay_t (S^T q_t) for Bd tokens, each row of S loaded
// once for NT tokens (their sums in registers); the scalar path's multiply-adds in its order.
// qs: q_t[i] * qscale [Bd][dk].
template <int NT>
static void readout_tile(const float * S, int dk, int dv, const float * qs, const float * dec, float * O, size_t onb) {
    for (int j0 = 0; j0 < dv; j0 += 16) {
        __m512 acc[NT];
        for (int u = 0; u < NT; u++) acc[u] = _mm512_setzero_ps();
        for (int i = 0; i < dk; i++) {
            const __m512 r = _mm512_loadu_ps(S + (size_t) i * dv + j0);
            for (int u = 0; u < NT; u++) acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(qs[(size_t) u * dk + i]), r, acc[u]);
        }
        for (int u = 0; u < NT; u++) _mm512_storeu_ps(O + u * onb + j0, _mm512_mul_ps(acc[u], _mm512_set1_ps(dec[u])));
    }
}

static void readout_avx512(const float * S, int dk, int dv, int Bd, const float * qs, const float * dec, float * O, size_t onb) {
    int t = 0;
    for (; t + 8 <= Bd; t += 8) readout_tile<8>(S, dk, dv, qs + (size_t) t * dk, dec + t, O + t * onb, onb);
    for (; t < Bd; t++) readout_tile<1>(S, dk, dv, qs + (size_t) t * dk, dec + t, O + t * onb, onb);
}
#endif

#if defined(__AVX512F__)
static const bool AVX512_GDN = true;
#else
static const bool AVX512_GDN = false;
#endif

static void gdn_mix_seg(const GdnCall & c, const GdnSeg & sg, ggml_tensor * dst, int ith, int nth);

static void gdn_mix(ggml_tensor * dst, int ith, int nth, void * ud) {
    const GdnCall & c = *(const GdnCall *) ud;
    for (const GdnSeg & sg : c.segs) gdn_mix_seg(c, sg, dst, ith, nth);
}

static void gdn_mix_seg(const GdnCall & c, const GdnSeg & sg, ggml_tensor * dst, int ith, int nth) {
    const Hparams & hp = c.m->hp;
    const Layer & L = *c.L;
    const ggml_tensor * act = dst->src[0];
    const ggml_tensor * alpha = dst->src[1];
    const ggml_tensor * beta = dst->src[2];
    const int dk = hp.dk, dv = hp.dv, hk = hp.hk, hv = hp.hv, key_dim = hk * dk;
    const int Tc = sg.Tc, Bd = sg.Bd;
    const bool record = sg.S0 != nullptr;
    const float * A = (const float *) L.ssm_a->data;  // -exp(A_log)
    const float * dtb = (const float *) L.dt->data;
    const size_t xnb = act->nb[1] / sizeof(float), anb = alpha->nb[1] / sizeof(float), bnb = beta->nb[1] / sizeof(float);
    const float * X = (const float *) act->data + (size_t) sg.col0 * xnb;
    const float * AL = (const float *) alpha->data + (size_t) sg.col0 * anb;
    const float * BE = (const float *) beta->data + (size_t) sg.col0 * bnb;
    float * O = (float *) dst->data + (size_t) sg.col0 * hv * dv;
    const float qscale = 1.f / sqrtf((float) dk);
    const size_t hs = (size_t) dk * dv;
    const bool fast = c.m->gdn_fast;
    std::vector<float> q(dk), k(dk), kv(dv), qh((size_t) Bd * dk), kh_((size_t) Bd * dk), p(Bd);
    std::vector<float> qn((size_t) std::max(Tc, Bd) * dk), kn((size_t) Tc * dk), dec(std::max(Tc, Bd)), bt(Tc);
    for (int h = ith; h < hv; h += nth) {
        const int kh = h % hk;
        float * S = sg.S + (size_t) h * hs;
        // ---- commit
        const size_t rw = (size_t) 2 * dk + dv + 2;  // one recorded token
        if (record) std::copy(S, S + hs, sg.S0 + (size_t) h * hs);
        const bool vec = fast && AVX512_GDN && dv % 16 == 0;
        if (vec && Tc) {
            for (int t = 0; t < Tc; t++) {  // commit_step's q, k, decay and beta per token
                const float * x = X + (size_t) t * xnb;
                float * qt = &qn[(size_t) t * dk], * kt = &kn[(size_t) t * dk];
                std::copy(x + kh * dk, x + kh * dk + dk, qt);
                std::copy(x + key_dim + kh * dk, x + key_dim + kh * dk + dk, kt);
                l2norm_inplace(fast, qt, dk);
                l2norm_inplace(fast, kt, dk);
                for (int i = 0; i < dk; i++) qt[i] *= qscale;
                dec[t] = expf(A[h] * softplus_t(AL[(size_t) t * anb + h] + dtb[h]));
                bt[t] = sigmoid_f(BE[(size_t) t * bnb + h]);
            }
#if defined(__AVX512F__)
            commit_tokens_avx512(S, dk, dv, Tc, qn.data(), kn.data(), dec.data(), bt.data(), X + 2 * key_dim + h * dv, xnb,
                                 O + (size_t) h * dv, (size_t) hv * dv);
#endif
        }
        for (int t = 0; t < Tc; t++) {
            const float * x = X + (size_t) t * xnb;
            const float * qr = x + kh * dk, * kr = x + key_dim + kh * dk, * v = x + 2 * key_dim + h * dv;
            const float al = AL[(size_t) t * anb + h], be = BE[(size_t) t * bnb + h];
            if (!vec) commit_step(fast, hp, L, h, S, qr, kr, v, al, be, O + ((size_t) t * hv + h) * dv, q.data(), k.data(), kv.data());
            if (record) {
                float * r = sg.rec + ((size_t) h * Tc + t) * rw;
                std::copy(qr, qr + dk, r);
                std::copy(kr, kr + dk, r + dk);
                std::copy(v, v + dv, r + 2 * dk);
                r[2 * dk + dv] = al;
                r[2 * dk + dv + 1] = be;
            }
        }
        if (!Bd) continue;
        // ---- denoise: decayed prefix readout + lambda_h(B) * softmax attention inside the block
        const float * sc = (const float *) L.intra_scale->data;
        const float gain = ((const float *) L.gain_a->data)[h] + ((const float *) L.gain_b->data)[h] * log2f((float) Bd / 32.f);
        for (int t = 0; t < Bd; t++) {
            const float * x = X + (size_t) (Tc + t) * xnb;
            std::copy(x + kh * dk, x + (kh + 1) * dk, &qh[(size_t) t * dk]);
            std::copy(x + key_dim + kh * dk, x + key_dim + (kh + 1) * dk, &kh_[(size_t) t * dk]);
            l2norm_inplace(fast, &qh[(size_t) t * dk], dk);
            l2norm_inplace(fast, &kh_[(size_t) t * dk], dk);
        }
        if (vec) {
            for (int t = 0; t < Bd; t++) {
                for (int i = 0; i < dk; i++) qn[(size_t) t * dk + i] = qh[(size_t) t * dk + i] * qscale;
                dec[t] = expf(A[h] * softplus_t(AL[(size_t) (Tc + t) * anb + h] + dtb[h]));
            }
#if defined(__AVX512F__)
            readout_avx512(S, dk, dv, Bd, qn.data(), dec.data(), O + ((size_t) Tc * hv + h) * dv, (size_t) hv * dv);
#endif
        }
        for (int t = 0; t < Bd; t++) {
            const float * qt = &qh[(size_t) t * dk];
            float * o = O + ((size_t) (Tc + t) * hv + h) * dv;
            if (!vec) {
                const float decay = expf(A[h] * softplus_t(AL[(size_t) (Tc + t) * anb + h] + dtb[h]));
                std::fill(o, o + dv, 0.f);
                for (int i = 0; i < dk; i++) {
                    const float qi = qt[i] * qscale;
                    const float * row = S + (size_t) i * dv;
                    for (int j = 0; j < dv; j++) o[j] += qi * row[j];
                }
                for (int j = 0; j < dv; j++) o[j] *= decay;
            }
            float mx = -INFINITY;
            for (int u = 0; u < Bd; u++) {
                p[u] = gdn_dot(fast, qt, &kh_[(size_t) u * dk], dk) * sc[h];
                mx = std::max(mx, p[u]);
            }
            float sum = 0.f;
            for (int u = 0; u < Bd; u++) {
                p[u] = expf(p[u] - mx);
                sum += p[u];
            }
            for (int u = 0; u < Bd; u++) {
                const float pu = gain * (p[u] / sum);
                const float * vv = X + (size_t) (Tc + u) * xnb + 2 * key_dim + h * dv;
                for (int j = 0; j < dv; j++) o[j] += pu * vv[j];
            }
        }
    }
}

// Block expert sharing (clover.moe.route with BlockSharing): src[0] router probabilities [E, T] ->
// the same, with the denoise columns [Tc, T) restricted to the block's `budget` best experts (ranked by
// the sum, or the max, of the block's probabilities); the others are zeroed. One task.
// The MoE's output: src[0] the routed slots' outputs [H, k, T], src[1] their weights [1, k, T], src[2]
// the shared expert's output [H, T], src[3] its gate [1, T] -> sum_e dn_e w_e + sh g [H, T]. The same
// operations as ggml's mul, add and mul nodes did it in (each product rounded, then the sums left to
// right; no multiply-add contraction), in one node instead of 2k + 1 with two broadcasts, which
// ggml runs as one call per element. Parallel over tokens.
__attribute__((optimize("fp-contract=off")))
static void moe_combine(ggml_tensor * dst, int ith, int nth, void *) {
    const ggml_tensor * dn = dst->src[0], * w = dst->src[1], * sh = dst->src[2], * sg = dst->src[3];
    const int64_t H = dst->ne[0], T = dst->ne[1], k = dn->ne[1];
    for (int64_t t = ith; t < T; t += nth) {
        const char * dt = (const char *) dn->data + t * dn->nb[2];
        const char * wt = (const char *) w->data + t * w->nb[2];
        const float * st = (const float *) ((const char *) sh->data + t * sh->nb[1]);
        const float g = *(const float *) ((const char *) sg->data + t * sg->nb[1]);
        float * y = (float *) ((char *) dst->data + t * dst->nb[1]);
        const float w0 = *(const float *) wt;
        const float * d0 = (const float *) dt;
        for (int64_t j = 0; j < H; j++) y[j] = d0[j] * w0;
        for (int64_t e = 1; e < k; e++) {
            const float we = *(const float *) (wt + e * w->nb[1]);
            const float * de = (const float *) (dt + e * dn->nb[1]);
            for (int64_t j = 0; j < H; j++) {
                const float pe = de[j] * we;
                y[j] = y[j] + pe;
            }
        }
        for (int64_t j = 0; j < H; j++) {
            const float ps = st[j] * g;
            y[j] = y[j] + ps;
        }
    }
}

// One denoise block's columns [c0, c1) and its sharing (a batched forward has one per row that shares).
struct ShareSeg {
    int c0, c1, budget;
    bool rank_max;
};

struct ShareCall {
    std::vector<ShareSeg> segs;  // set before each compute
};

static void block_share(ggml_tensor * dst, int ith, int, void * ud) {
    if (ith != 0) return;
    const ShareCall & c = *(const ShareCall *) ud;
    const ggml_tensor * src = dst->src[0];
    const int E = (int) src->ne[0], T = (int) src->ne[1];
    const size_t snb = src->nb[1] / sizeof(float), dnb = dst->nb[1] / sizeof(float);
    const float * P = (const float *) src->data;
    float * D = (float *) dst->data;
    for (int t = 0; t < T; t++) std::copy(P + (size_t) t * snb, P + (size_t) t * snb + E, D + (size_t) t * dnb);
    for (const ShareSeg & sg : c.segs) {
        std::vector<float> score(E, 0.f);
        for (int t = sg.c0; t < sg.c1; t++)
            for (int e = 0; e < E; e++) {
                const float v = P[(size_t) t * snb + e];
                score[e] = sg.rank_max ? std::max(score[e], v) : score[e] + v;
            }
        std::vector<int> order(E);
        for (int e = 0; e < E; e++) order[e] = e;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return score[a] > score[b]; });
        std::vector<char> keep(E, 0);
        for (int i = 0; i < std::min(sg.budget, E); i++) keep[order[i]] = 1;
        for (int t = sg.c0; t < sg.c1; t++)
            for (int e = 0; e < E; e++)
                if (!keep[e]) D[(size_t) t * dnb + e] = 0.f;
    }
}

// ------------------------------------------------------------------- the grouped expert matmul
// For a forward of several tokens, ggml_mul_mat_id multiplies each routed (token, slot) pair by its
// expert with one vec_dot per weight row: the tokens routed to one expert share a weight row only
// through its 16x16 blocking, and none of the tiled kernels a dense matmul uses runs. moe_grouped
// instead gathers, per expert, the tokens routed to it into one [H, n] matrix and runs that expert's
// FFN on it as plain ggml_mul_mat's (gate, up, SiLU(gate) * up, down): ggml's dense kernels
// (llamafile's tinyBLAS for n >= 2, vec_dot for n = 1, each weight type's own), through a small
// graph kept per (n, weight types) and computed by ggml_graph_compute on a one-thread pool owned by
// the op's thread. The down projections scatter back to [H, k, T], mul_mat_id's layout, and are
// weighted and summed over the slots as before. Experts are dealt to the op's threads whole, so an
// expert's arithmetic does not depend on the thread count.
//   src[0] h [H, T] (f32), src[1] selected experts [k, T] (i32) -> dst [H, k, T]
struct ExpertGraph {
    ggml_context * ctx = nullptr;
    ggml_cgraph * gf = nullptr;
    ggml_tensor *wg = nullptr, *wu = nullptr, *wd = nullptr, *x = nullptr, *out = nullptr;
    std::vector<uint8_t> arena, work;
    ggml_cplan plan{};
};

struct ExpertWorker {  // one per thread of the op
    ggml_threadpool * pool = nullptr;
    std::map<std::vector<int>, std::unique_ptr<ExpertGraph>> graphs;  // key: n, the three weight types
    std::vector<int> rows;  // this forward's (slot, token) pairs of the expert at hand
    std::vector<float> x, g, u, d;  // the row-dot path's gathered input, gate, up (then SiLU(gate) * up), down
    std::vector<uint8_t> xq;
};

// An expert with fewer tokens than this goes by per-row dot products (below), one with at least this
// many by ggml_mul_mat (tinyBLAS). Measured on one core with weights that are not in cache (every
// expert's weights are read once per forward): a [2048 -> 512] q8_0 matrix times n columns takes
// 98 / 173 / 300 / 593 us by row dots for n = 2 / 4 / 8 / 16 and 169 / 250 / 257 / 372 us by
// tinyBLAS, which wins only from n = 8 (with the weights in cache it wins from n = 2).
static const int MOE_GEMM_MIN = 8;

// Y [n][R] = W X for one expert matrix W [R rows of K] (weight type `type`) and X [n][K] f32, as
// ggml_mul_mat_id computes it: X converted to the type's vec_dot type, then 16 weight rows at a time
// against every column, one vec_dot each (a weight row is read from memory once).
static void rows_dot(ggml_type type, const char * W, int K, int R, const float * X, int n, float * Y, std::vector<uint8_t> & xq) {
    const auto * tr = ggml_get_type_traits_cpu(type);
    const ggml_type vt = tr->vec_dot_type;
    const size_t xrow = ggml_row_size(vt, K), wrow = ggml_row_size(type, K);
    xq.resize(xrow * n);
    for (int j = 0; j < n; j++) {
        if (vt == GGML_TYPE_F32) memcpy(&xq[xrow * j], X + (size_t) j * K, xrow);
        else ggml_get_type_traits_cpu(vt)->from_float(X + (size_t) j * K, &xq[xrow * j], K);
    }
    for (int i0 = 0; i0 < R; i0 += 16)
        for (int j = 0; j < n; j++)
            for (int i = i0; i < std::min(R, i0 + 16); i++)
                tr->vec_dot(K, &Y[(size_t) j * R + i], 0, W + wrow * i, 0, &xq[xrow * j], 0, 1);
}

struct MoeCall {
    const Layer * L;
    std::vector<ExpertWorker> * workers;
};

static std::vector<ExpertWorker> & expert_workers(int n_threads) {  // created once, one per thread
    static std::vector<ExpertWorker> workers;
    while ((int) workers.size() < n_threads) {
        workers.emplace_back();
        ggml_threadpool_params tp = ggml_threadpool_params_default(1);
        workers.back().pool = ggml_threadpool_new(&tp);
    }
    return workers;
}

static ExpertGraph * expert_graph(ExpertWorker & w, const Layer & L, int n) {
    const std::vector<int> key = {n, (int) L.gate_exps->type, (int) L.up_exps->type, (int) L.down_exps->type};
    auto it = w.graphs.find(key);
    if (it != w.graphs.end()) return it->second.get();
    auto g = std::make_unique<ExpertGraph>();
    const int64_t H = L.gate_exps->ne[0], I = L.gate_exps->ne[1];
    ggml_init_params ip = {ggml_tensor_overhead() * 16 + ggml_graph_overhead_custom(16, false), nullptr, true};
    ggml_context * ctx = g->ctx = ggml_init(ip);
    g->wg = ggml_new_tensor_2d(ctx, L.gate_exps->type, H, I);  // data: the expert's slice, set per call
    g->wu = ggml_new_tensor_2d(ctx, L.up_exps->type, H, I);
    g->wd = ggml_new_tensor_2d(ctx, L.down_exps->type, I, H);
    g->x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, H, n);
    ggml_tensor * par = ggml_swiglu_split(ctx, ggml_mul_mat(ctx, g->wg, g->x), ggml_mul_mat(ctx, g->wu, g->x));
    g->out = ggml_mul_mat(ctx, g->wd, par);
    g->gf = ggml_new_graph_custom(ctx, 16, false);
    ggml_build_forward_expand(g->gf, g->out);
    std::vector<ggml_tensor *> acts = {g->x};  // every activation gets a slot of the arena
    for (int i = 0; i < ggml_graph_n_nodes(g->gf); i++) acts.push_back(ggml_graph_node(g->gf, i));
    size_t size = 0;
    for (ggml_tensor * t : acts) size += GGML_PAD(ggml_nbytes(t), 64);
    g->arena.resize(size + 64);
    uint8_t * base = (uint8_t *) GGML_PAD((uintptr_t) g->arena.data(), 64);
    for (ggml_tensor * t : acts) {
        t->data = base;
        base += GGML_PAD(ggml_nbytes(t), 64);
    }
    g->plan = ggml_graph_plan(g->gf, 1, w.pool);
    g->work.resize(g->plan.work_size + 64);
    g->plan.work_data = g->work.data();
    return w.graphs.emplace(key, std::move(g)).first->second.get();
}

static void moe_grouped(ggml_tensor * dst, int ith, int nth, void * ud) {
    const MoeCall & c = *(const MoeCall *) ud;
    const Layer & L = *c.L;
    ExpertWorker & w = (*c.workers)[ith];
    const ggml_tensor * h = dst->src[0], * sel = dst->src[1];
    const int64_t H = h->ne[0], T = h->ne[1], k = sel->ne[0], E = L.gate_exps->ne[2];
    std::vector<int> count(E, 0);
    for (int64_t t = 0; t < T; t++)
        for (int64_t s = 0; s < k; s++) count[*(const int32_t *) ((const char *) sel->data + t * sel->nb[1] + s * sel->nb[0])]++;
    int active = 0;
    for (int64_t e = 0; e < E; e++) {
        if (!count[e] || active++ % nth != ith) continue;  // the active experts dealt round-robin
        w.rows.clear();
        for (int64_t t = 0; t < T; t++)
            for (int64_t s = 0; s < k; s++)
                if (*(const int32_t *) ((const char *) sel->data + t * sel->nb[1] + s * sel->nb[0]) == e) {
                    w.rows.push_back((int) s);
                    w.rows.push_back((int) t);
                }
        const int n = count[e];
        const char * wg = (const char *) L.gate_exps->data + e * L.gate_exps->nb[2];
        const char * wu = (const char *) L.up_exps->data + e * L.up_exps->nb[2];
        const char * wd = (const char *) L.down_exps->data + e * L.down_exps->nb[2];
        const float * D;
        if (n >= MOE_GEMM_MIN) {
            ExpertGraph * g = expert_graph(w, L, n);
            g->wg->data = (void *) wg;
            g->wu->data = (void *) wu;
            g->wd->data = (void *) wd;
            float * X = (float *) g->x->data;
            for (int j = 0; j < n; j++)
                memcpy(X + (size_t) j * H, (const char *) h->data + w.rows[2 * j + 1] * h->nb[1], sizeof(float) * H);
            if (ggml_graph_compute(g->gf, &g->plan) != GGML_STATUS_SUCCESS) die("expert graph compute failed");
            D = (const float *) g->out->data;
        } else {
            const int I = (int) L.gate_exps->ne[1];
            w.x.resize((size_t) n * H);
            w.g.resize((size_t) n * I);
            w.u.resize((size_t) n * I);
            w.d.resize((size_t) n * H);
            for (int j = 0; j < n; j++)
                memcpy(&w.x[(size_t) j * H], (const char *) h->data + w.rows[2 * j + 1] * h->nb[1], sizeof(float) * H);
            rows_dot(L.gate_exps->type, wg, (int) H, I, w.x.data(), n, w.g.data(), w.xq);
            rows_dot(L.up_exps->type, wu, (int) H, I, w.x.data(), n, w.u.data(), w.xq);
            for (size_t i = 0; i < w.g.size(); i++) w.u[i] *= w.g[i] / (1.f + expf(-w.g[i]));  // SiLU(gate) * up
            rows_dot(L.down_exps->type, wd, I, (int) H, w.u.data(), n, w.d.data(), w.xq);
            D = w.d.data();
        }
        for (int j = 0; j < n; j++)
            memcpy((char *) dst->data + w.rows[2 * j] * dst->nb[1] + w.rows[2 * j + 1] * dst->nb[2], D + (size_t) j * H, sizeof(float) * H);
    }
}

// ------------------------------------------------------------------- the wide q8_0 matmul
// ggml multiplies a q8_0 matrix by a few columns with tinyBLAS (a 4x4 tile: per weight block, row and
// column two sign flips, a 32-lane dot, a conversion and a float multiply-add) or with one vec_dot
// per row and column (mul_mat_id; any single column): a few multiply-adds per vector instruction, so
// a forward of 8 tokens is bound by its multiply-adds, not by its weight reads. The port repacks each
// q8_0 matrix once at load, 16 rows interleaved per 32-column block (16 fp16 scales, then for each
// 4-column quad the 16 rows' 4 bytes: one 64-byte vector), and multiplies it with AVX-512 VNNI: one
// vpdpbusd gives the quad's integer dot for 16 rows of a column, one conversion and one float
// multiply-add per quad take it into that row's lane, as ggml's q8_0 vec_dot does for one row
// (arch/x86/quants.c: 8 float lanes per row, lane q accumulating d_w * d_x * the dot of bytes
// 4q..4q+3 block by block, then hsum_float_8's order). The weights are stored offset by 128 (unsigned
// bytes, as vpdpbusd wants one side), the columns quantized by ggml's own quantize_row_q8_0, and each
// quad's dot starts at -128 * the column's quad sum (computed once per column). So every column
// is computed bit for bit as ggml's vec_dot computes it (the kernel of an AR step and of
// mul_mat_id), by about a fifth of the instructions, and the weights are prefetched Q8_PREFETCH
// bytes ahead (one core does not stream them at full rate from the hardware prefetch alone). Used
// for every q8_0 matmul, of any forward (an AR step too): the dense projections, the output layer,
// and the routed experts (mul_mat_id's graph, each active expert's gathered columns in one product);
// `--matmul ggml` keeps ggml's kernels. Needs AVX-512 VNNI at build time (-march=native); elsewhere
// the port uses ggml's kernels. `--mode check-matmul` compares it against ggml's vec_dot.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define CLOVER_WIDE_Q8 1
#else
#define CLOVER_WIDE_Q8 0
#endif

struct Q8Block { uint16_t d; int8_t qs[32]; };  // ggml's block_q8_0
static_assert(sizeof(Q8Block) == 34, "block_q8_0 is 34 bytes");
static const size_t Q8G = 16 * sizeof(Q8Block);  // one 16-row group's block, repacked: 16 scales, 512 quants
static const size_t Q8_PREFETCH = 4096;  // 2-4 KB ahead: a width-8 forward at 0.7B 151 -> 117-123 ms (16 KB the same)

struct PackedQ8 {  // a q8_0 matrix [R rows of K] (E of them: experts), repacked as above
    std::vector<uint8_t> data;
    int64_t R = 0, K = 0, E = 1;
    size_t bytes() const { return (size_t) (R / 16) * (K / 32) * Q8G; }  // one matrix (expert)
};

static bool packable(const ggml_tensor * w) {
    return w && w->type == GGML_TYPE_Q8_0 && w->ne[0] % 32 == 0 && w->ne[1] % 16 == 0 && w->ne[3] == 1 && ggml_is_contiguous(w);
}

static void pack_q8(PackedQ8 & p, const ggml_tensor * w) {
    p.K = w->ne[0], p.R = w->ne[1], p.E = w->ne[2];
    const int64_t B = p.K / 32, G = p.R / 16;
    p.data.resize(p.bytes() * p.E);
    for (int64_t e = 0; e < p.E; e++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t r = 0; r < 16; r++) {
                const Q8Block * row = (const Q8Block *) ((const char *) w->data + e * w->nb[2] + (g * 16 + r) * w->nb[1]);
                for (int64_t b = 0; b < B; b++) {
                    uint8_t * o = &p.data[e * p.bytes() + (g * B + b) * Q8G];
                    memcpy(o + 2 * r, &row[b].d, 2);
                    for (int i = 0; i < 32; i++) o[32 + 64 * (i / 4) + 4 * r + i % 4] = (uint8_t) row[b].qs[i] ^ 0x80;  // + 128
                }
            }
}

// n columns of K floats, quantized to q8_0 by ggml: quants q [n][K], scales d [n][K/32], and per 4-value
// quad -128 * its sum, s [n][K/4] (the start of each quad's dot against the offset weights)
struct Q8Cols {
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int32_t> s;
    std::vector<Q8Block> tmp;
    int64_t K = 0;
    int n = 0;
};

static void quantize_cols(Q8Cols & c, const float * X, size_t ldx, int n, int64_t K) {
    static const ggml_from_float_t quantize = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0)->from_float;
    const int64_t B = K / 32;
    c.K = K, c.n = n;
    c.q.resize((size_t) n * K);
    c.d.resize((size_t) n * B);
    c.s.resize((size_t) n * K / 4);
    c.tmp.resize(B);
    for (int j = 0; j < n; j++) {
        quantize(X + j * ldx, c.tmp.data(), K);
        for (int64_t b = 0; b < B; b++) {
            c.d[j * B + b] = ggml_fp16_to_fp32(c.tmp[b].d);
            memcpy(&c.q[(size_t) j * K + 32 * b], c.tmp[b].qs, 32);
            for (int i = 0; i < 8; i++) {
                const int8_t * v = c.tmp[b].qs + 4 * i;
                c.s[(size_t) j * K / 4 + 8 * b + i] = -128 * (v[0] + v[1] + v[2] + v[3]);
            }
        }
    }
}

#if CLOVER_WIDE_Q8
// y[j * ldy + 0..15] = the 16 rows of group `wg` times column j, for NC columns, as ggml's q8_0 vec_dot
// sums (arch/x86/quants.c): per row 8 float lanes, lane q accumulating fma(d_w * d_x, the integer dot
// of the block's bytes 4q..4q+3, lane) over the blocks in order, then hsum_float_8's order
template <int NC>
static void q8_tile(const uint8_t * wg, int64_t B, const Q8Cols & x, int j0, float * y, int64_t ldy) {
    const int64_t K = x.K;
    __m512 acc[NC][8];
    for (int j = 0; j < NC; j++)
        for (int q = 0; q < 8; q++) acc[j][q] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        const uint8_t * blk = wg + b * Q8G;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) blk));
        __m512 d[NC];
        for (int j = 0; j < NC; j++) d[j] = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(j0 + j) * B + b]));
#pragma GCC unroll 8  // unrolled, the lane accumulators stay in registers (a runtime q keeps them on the stack)
        for (int q = 0; q < 8; q++) {
            _mm_prefetch((const char *) blk + Q8_PREFETCH + 64 * q, _MM_HINT_T0);
            const __m512i w = _mm512_loadu_si512(blk + 32 + 64 * q);  // 16 rows x 4 bytes, each + 128
            for (int j = 0; j < NC; j++) {
                int32_t xv;
                memcpy(&xv, &x.q[(j0 + j) * K + 32 * b + 4 * q], 4);
                // the quad's dot: sum (w + 128) x, started at -128 sum x
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_set1_epi32(x.s[(j0 + j) * K / 4 + 8 * b + q]), w, _mm512_set1_epi32(xv));
                acc[j][q] = _mm512_fmadd_ps(d[j], _mm512_cvtepi32_ps(dot), acc[j][q]);
            }
        }
    }
    for (int j = 0; j < NC; j++) {
        const __m512 lo = _mm512_add_ps(_mm512_add_ps(acc[j][0], acc[j][4]), _mm512_add_ps(acc[j][2], acc[j][6]));
        const __m512 hi = _mm512_add_ps(_mm512_add_ps(acc[j][1], acc[j][5]), _mm512_add_ps(acc[j][3], acc[j][7]));
        _mm512_storeu_ps(y + j * ldy, _mm512_add_ps(lo, hi));
    }
}
#endif

static const int Q8_COLS = 3;  // columns per tile: 3 x 8 lane accumulators fit the 32 vector registers

// Y [n][ldy] rows [16 g0, 16 g1) = W x for the packed matrix W (one expert's) and the quantized columns x
static void q8_matmul(const uint8_t * W, int64_t K, const Q8Cols & x, float * Y, int64_t ldy, int64_t g0, int64_t g1) {
#if CLOVER_WIDE_Q8
    const int64_t B = K / 32;
    for (int64_t g = g0; g < g1; g++)
        for (int j0 = 0, left = x.n; left > 0; ) {  // the columns in tiles of at most Q8_COLS, as even as can be
            const int nc = (left + (left + Q8_COLS - 1) / Q8_COLS - 1) / ((left + Q8_COLS - 1) / Q8_COLS);
            const uint8_t * wg = W + g * B * Q8G;
            float * y = Y + j0 * ldy + 16 * g;
            switch (nc) {
                case 1: q8_tile<1>(wg, B, x, j0, y, ldy); break;
                case 2: q8_tile<2>(wg, B, x, j0, y, ldy); break;
                default: q8_tile<3>(wg, B, x, j0, y, ldy); break;
            }
            j0 += nc, left -= nc;
        }
#else
    (void) W, (void) K, (void) x, (void) Y, (void) ldy, (void) g0, (void) g1;
    die("the wide q8_0 matmul needs AVX-512 VNNI");
#endif
}

// dst [R, T] = W src[0] [K, T] (contiguous); userdata: the PackedQ8. The 16-row groups are split among the threads.
static void q8_dense(ggml_tensor * dst, int ith, int nth, void * ud) {
    const PackedQ8 & w = *(const PackedQ8 *) ud;
    const ggml_tensor * x = dst->src[0];
    thread_local Q8Cols c;
    quantize_cols(c, (const float *) x->data, x->nb[1] / sizeof(float), (int) x->ne[1], w.K);
    const int64_t G = w.R / 16, per = (G + nth - 1) / nth;
    q8_matmul(w.data.data(), w.K, c, (float *) dst->data, dst->nb[1] / sizeof(float), std::min(G, ith * per), std::min(G, (ith + 1) * per));
}

// ggml_mul_mat_id with the packed expert matrices: dst [R, k, T] = expert ids[s, t] times column
// src[0][:, s or 0, t] (src[0] [K, k or 1, T], contiguous; src[1] ids [k, T]); every column quantized
// once, each active expert's columns gathered into one product; experts dealt to the threads whole.
static void q8_mul_mat_id(ggml_tensor * dst, int ith, int nth, void * ud) {
    const PackedQ8 & w = *(const PackedQ8 *) ud;
    const ggml_tensor * b = dst->src[0], * ids = dst->src[1];
    const int64_t K = w.K, BK = K / 32, nb = b->ne[1], k = ids->ne[0], T = ids->ne[1];
    thread_local Q8Cols xb, xe;
    thread_local std::vector<float> y;
    thread_local std::vector<int> rows;
    quantize_cols(xb, (const float *) b->data, b->nb[1] / sizeof(float), (int) (nb * T), K);
    auto expert_of = [&](int64_t t, int64_t s) { return *(const int32_t *) ((const char *) ids->data + t * ids->nb[1] + s * ids->nb[0]); };
    std::vector<int> count(w.E, 0);
    for (int64_t t = 0; t < T; t++)
        for (int64_t s = 0; s < k; s++) count[expert_of(t, s)]++;
    int active = 0;
    for (int64_t e = 0; e < w.E; e++) {
        if (!count[e] || active++ % nth != ith) continue;
        const int n = count[e];
        rows.clear();
        xe.K = K, xe.n = n;
        xe.q.resize((size_t) n * K);
        xe.d.resize((size_t) n * BK);
        xe.s.resize((size_t) n * K / 4);
        for (int64_t t = 0; t < T; t++)
            for (int64_t s = 0; s < k; s++)
                if (expert_of(t, s) == e) {
                    const size_t j = rows.size() / 2, c = (size_t) (t * nb + (nb == 1 ? 0 : s));
                    memcpy(&xe.q[j * K], &xb.q[c * K], K);
                    memcpy(&xe.d[j * BK], &xb.d[c * BK], sizeof(float) * BK);
                    memcpy(&xe.s[j * K / 4], &xb.s[c * K / 4], sizeof(int32_t) * K / 4);
                    rows.push_back((int) s);
                    rows.push_back((int) t);
                }
        y.resize((size_t) n * w.R);
        q8_matmul(w.data.data() + e * w.bytes(), K, xe, y.data(), w.R, 0, w.R / 16);
        for (int j = 0; j < n; j++)
            memcpy((char *) dst->data + rows[2 * j] * dst->nb[1] + rows[2 * j + 1] * dst->nb[2], &y[(size_t) j * w.R], sizeof(float) * w.R);
    }
}

// The packed copies of the model's q8_0 matmul weights (made once, at load, with --matmul wide).
static std::map<const ggml_tensor *, PackedQ8> & packed_q8() {
    static std::map<const ggml_tensor *, PackedQ8> packed;
    return packed;
}

static const PackedQ8 * packed_of(const ggml_tensor * w) {
    auto it = packed_q8().find(w);
    return it == packed_q8().end() ? nullptr : &it->second;
}

static void pack_model(const Model & m) {
    auto add = [](const ggml_tensor * w) { if (packable(w) && !packed_q8().count(w)) pack_q8(packed_q8()[w], w); };
    for (const Layer & L : m.layers)
        for (const ggml_tensor * w : {L.wq, L.wk, L.wv, L.wo, L.wqkv, L.wgate, L.wbeta, L.walpha, L.ssm_out,
                                      L.up_exps, L.gate_exps, L.down_exps, L.gate_shexp, L.up_shexp, L.down_shexp})
            add(w);
    add(m.output);
}

// --mode check-matmul: every packed matrix (the first and last expert of the expert tensors) times
// n = 1..9 and 16 random columns, by the wide kernel and by ggml's q8_0 vec_dot (each row against each
// column quantized by ggml), the largest difference relative to the largest |result|: one JSON line.
static std::string check_matmul() {
    static const auto * tr = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0);
    std::mt19937 rng(0);
    std::normal_distribution<float> normal;
    double worst = 0;
    int checked = 0;
    for (auto & [w, p] : packed_q8())
        for (int64_t e : std::set<int64_t>{0, p.E - 1})
            for (int n : {1, 2, 3, 4, 5, 6, 7, 8, 9, 16}) {
                std::vector<float> X((size_t) n * p.K), Y((size_t) n * p.R);
                for (float & v : X) v = normal(rng);
                Q8Cols c;
                quantize_cols(c, X.data(), p.K, n, p.K);
                q8_matmul(p.data.data() + e * p.bytes(), p.K, c, Y.data(), p.R, 0, p.R / 16);
                std::vector<Q8Block> xq(p.K / 32);
                double diff = 0, scale = 0;
                for (int j = 0; j < n; j++) {
                    tr->from_float(&X[(size_t) j * p.K], xq.data(), p.K);
                    for (int64_t r = 0; r < p.R; r++) {
                        float ref;
                        tr->vec_dot((int) p.K, &ref, 0, (const char *) w->data + e * w->nb[2] + r * w->nb[1], 0, xq.data(), 0, 1);
                        diff = std::max(diff, (double) std::fabs(ref - Y[(size_t) j * p.R + r]));
                        scale = std::max(scale, (double) std::fabs(ref));
                    }
                }
                worst = std::max(worst, diff / std::max(scale, 1e-30));
                checked++;
            }
    char buf[128];
    snprintf(buf, sizeof buf, "{\"matrices\": %d, \"checks\": %d, \"max_rel_diff\": %.3e}", (int) packed_q8().size(), checked, worst);
    return buf;
}

// ------------------------------------------------------------------------------------ the forward
struct Forward {
    std::vector<float> logits;  // [n_out][V], rows in the order of `out_rows`
};

// commit: tokens appended to the cache; block: one denoise block read against the cache after the
// commit (not written); out_rows: indices into [commit | block] whose logits are wanted.
// The graph of one forward shape, kept for the next forward of that shape: the cache positions it
// writes and the key length it reads are inputs (K/V rows written by ggml_set_rows at input indices;
// attention reads the cache padded to KV_PAD positions, the padding masked), so a graph depends only on
// the shape (commit length, block length, logit rows, padded key length, expert sharing)
// and is built, planned and allocated once.
struct CachedGraph {
    ggml_context * ctx = nullptr;
    ggml_cgraph * gf = nullptr;
    ggml_gallocr_t galloc = nullptr;
    ggml_tensor *ids = nullptr, *pos = nullptr, *kq_mask = nullptr, *out_ids = nullptr, *kv_idx = nullptr, *logits = nullptr;
    ggml_tensor *q_idx = nullptr, *o_idx = nullptr;  // batched rows: the columns gathered into [Tq, R] for attention, and back
    ggml_tensor * feats = nullptr;  // dflash: the drafter's context features of the commit [F, Tc]
    std::vector<GdnCall> calls;
    std::vector<MoeCall> moe_calls;
    ShareCall share_call{};
    uint64_t used = 0;
    ~CachedGraph() {
        if (galloc) ggml_gallocr_free(galloc);
        if (ctx) ggml_free(ctx);
    }
};

static std::map<std::vector<int>, std::unique_ptr<CachedGraph>> & graph_cache() {
    static std::map<std::vector<int>, std::unique_ptr<CachedGraph>> graphs;
    return graphs;
}

static CachedGraph * build_graph(Model & m, int Tc, int Bd, int n_out, int n_kv, bool taps, bool exact, int R, int Tq, bool share);

// The graph of `key`, built by `build` the first time (the least recently used of 48 goes).
static CachedGraph & graph_for(const std::vector<int> & key, const std::function<CachedGraph *()> & build) {
    auto & graphs = graph_cache();
    static uint64_t tick = 0;
    auto it = graphs.find(key);
    if (it == graphs.end()) {
        if (graphs.size() >= 48) {
            auto old = graphs.begin();
            for (auto g = graphs.begin(); g != graphs.end(); ++g) if (g->second->used < old->second->used) old = g;
            graphs.erase(old);
        }
        it = graphs.emplace(key, std::unique_ptr<CachedGraph>(build())).first;
    }
    it->second->used = ++tick;
    return *it->second;
}

// CLOVER_PORT_PROFILE=1: every forward's graph computed node by node, the CPU time of each node summed
// per forward shape and per node kind (the op, and a matmul's weight), the table printed to stderr at
// exit. Same results, slower (each node is one graph compute); for finding where a forward's time goes.
static bool profiling() {
    static const bool on = std::getenv("CLOVER_PORT_PROFILE") != nullptr;
    return on;
}
struct ProfileRow { double s = 0; long n = 0; };
static double cpu_now() {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static std::map<std::string, std::map<std::string, ProfileRow>> & profile_table() {
    static std::map<std::string, std::map<std::string, ProfileRow>> table;
    static const bool registered = [] {
        std::atexit([] {
            double fwd = 0;
            for (auto & [shape, rows] : profile_table()) fwd += rows["(forward)"].s;
            std::fprintf(stderr, "== process CPU %.3f s, of which forwards %.3f s (node by node)\n", cpu_now(), fwd);
            for (auto & [shape, rows] : profile_table()) {
                const ProfileRow & all = rows["(forward)"];
                std::fprintf(stderr, "\n== forward %s: %ld forwards, %.3f ms CPU each\n", shape.c_str(), all.n, 1e3 * all.s / std::max(1L, all.n));
                std::vector<std::pair<double, std::string>> order;
                for (auto & [k, r] : rows) if (k != "(forward)") order.push_back({r.s, k});
                std::sort(order.rbegin(), order.rend());
                for (auto & [sec, k] : order)
                    std::fprintf(stderr, "  %8.4f ms %5.1f%%  %s\n", 1e3 * sec / std::max(1L, all.n), 100 * sec / std::max(1e-12, all.s), k.c_str());
            }
        });
        return true;
    }();
    (void) registered;
    return table;
}
static void profile_compute(Model & m, ggml_cgraph * gf, const std::string & shape) {
    auto & rows = profile_table()[shape];
    static std::vector<uint8_t> mem(ggml_graph_overhead_custom(1, false) + 1024);
    ggml_init_params ip = {mem.size(), mem.data(), true};
    ggml_context * ctx = ggml_init(ip);
    ggml_cgraph * one = ggml_new_graph_custom(ctx, 1, false);
    const double t0 = cpu_now();
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        ggml_tensor * node = ggml_graph_node(gf, i);
        ggml_graph_clear(one);
        ggml_graph_add_node(one, node);
        const double t = cpu_now();
        if (ggml_backend_graph_compute(m.backend, one) != GGML_STATUS_SUCCESS) die("graph compute failed");
        std::string k = ggml_op_desc(node);
        if (node->op == GGML_OP_MUL_MAT || node->op == GGML_OP_MUL_MAT_ID || node->op == GGML_OP_CUSTOM) {
            const char * name = node->op == GGML_OP_CUSTOM ? node->name : node->src[0]->name;
            const char * dot = std::strchr(name, '.');  // blk.N.attn_q.weight -> attn_q.weight
            k += std::string(" ") + (std::strncmp(name, "blk.", 4) == 0 && dot && std::strchr(dot + 1, '.') ? std::strchr(dot + 1, '.') + 1 : name);
        }
        ProfileRow & r = rows[k];
        r.s += cpu_now() - t;
        r.n++;
    }
    ProfileRow & all = rows["(forward)"];
    all.s += cpu_now() - t0;
    all.n++;
    ggml_free(ctx);
}

// A graph's input (one the graph does not use has no buffer), and an f32 attention mask [n_kv, rows]
// into kq_mask (flash attention's is f16).
static void set_input(ggml_tensor * t, const void * data, size_t n) {
    if (t && t->buffer) ggml_backend_tensor_set(t, data, 0, n);
}
static void set_mask(ggml_tensor * kq_mask, const std::vector<float> & mask) {
    if (kq_mask->type == GGML_TYPE_F16) {
        std::vector<ggml_fp16_t> mask16(mask.size());
        ggml_fp32_to_fp16_row(mask.data(), mask16.data(), (int64_t) mask.size());
        set_input(kq_mask, mask16.data(), sizeof(ggml_fp16_t) * mask16.size());
    } else {
        set_input(kq_mask, mask.data(), sizeof(float) * mask.size());
    }
}

// A forward's graph computed (node by node, timed per shape, where profiling); shape() names it, called
// only where profiling or failed (not a string built per forward).
template <class Shape> static void compute(Model & m, ggml_cgraph * gf, const Shape & shape) {
    if (profiling()) profile_compute(m, gf, shape());
    else if (ggml_backend_graph_compute(m.backend, gf) != GGML_STATUS_SUCCESS) die("graph compute failed: " + shape());
}

static thread_local Seq * tl_seq = nullptr;  // the batched row this thread decodes (--parallel), or null
static Seq & row_of(Model & m) { return tl_seq ? *tl_seq : m.row; }  // the row this thread decodes

// Whether a row's block of Bd tokens shares experts (its block a segment of the share op).
static bool row_shares(const Model & m, const Seq & q, int Bd) {
    return Bd > 0 && q.share_budget > 0 && q.share_budget < m.hp.n_expert;
}

// How many of a row's keys (its cache slot's first) its query t sees: a commit query the prefix and
// the commit up to itself, a block query everything up to the row's end.
static int visible_keys(int n_past, int Tc, int Bd, int t) { return t < Tc ? n_past + t + 1 : n_past + Tc + Bd; }

// A row's columns [col, col + Tc + Bd) of a forward's graph G (its GDN and share segments cleared
// before the first row): their token ids, positions and cache rows (in its slot) from `col` in ids,
// pos and kvi; the GDN ops' segments over its state (with record, also the buffers a rollback reads:
// the state before the commit, the commit's inputs, its conv window); its block's share segment.
static void row_columns(Model & m, Seq & q, CachedGraph & G, int col, const std::vector<int> & commit, const std::vector<int> & block,
                        bool record, int32_t * ids, int32_t * pos, int64_t * kvi) {
    const Hparams & hp = m.hp;
    const int Tc = (int) commit.size(), Bd = (int) block.size();
    for (int t = 0; t < Tc + Bd; t++) {
        ids[col + t] = t < Tc ? commit[t] : block[t - Tc];
        pos[col + t] = q.n_past + t;
        kvi[col + t] = (int64_t) q.slot * m.n_ctx + q.n_past + t;
    }
    if (row_shares(m, q, Bd)) G.share_call.segs.push_back({col + Tc, col + Tc + Bd, q.share_budget, q.share_max});
    if (record) {
        q.rec_T = Tc;
        q.window_len = hp.conv_k - 1 + Tc;
    }
    for (int il = 0; il < hp.n_layer; il++) {
        if (!m.layers[il].recurrent) continue;
        if (record) {
            q.S0[il].resize(q.S[il].size());
            q.rec[il].resize((size_t) hp.hv * Tc * (2 * hp.dk + hp.dv + 2));
            q.window[il].resize((size_t) hp.conv_dim() * q.window_len);
        }
        G.calls[il].segs.push_back({col, Tc, Bd, q.conv[il].data(), q.S[il].data(), record && Tc ? q.window[il].data() : nullptr,
                                    record ? q.S0[il].data() : nullptr, record ? q.rec[il].data() : nullptr});
    }
}

// commit: tokens appended to the cache; block: one denoise block read against the cache after the
// commit (not written); out_rows: indices into [commit | block] whose logits are wanted. `feats`
// (dflash): also the drafter's context features of the commit tokens, [Tc][F]. `exact`: each column's
// matmuls computed as a one-token forward's (build_graph). The row is the model's own (a batched
// row's forward joins the next batch).
static void batch_submit(Model & m, const std::vector<int> & commit, const std::vector<int> & block,
                         const std::vector<int> & out_rows, bool record, Forward & res);

static void forward(Model & m, const std::vector<int> & commit, const std::vector<int> & block,
                    const std::vector<int> & out_rows, bool record, Forward & res, std::vector<float> * feats = nullptr,
                    bool exact = false) {
    if (tl_seq) {  // a batched row: its forward joins the next batch (forward_batch)
        if (feats || exact) die("internal: a batched row's forward taps or verifies exactly");
        batch_submit(m, commit, block, out_rows, record, res);
        return;
    }
    const Hparams & hp = m.hp;
    Seq & q = m.row;
    const int Tc = (int) commit.size(), Bd = (int) block.size(), T = Tc + Bd;
    if (T == 0) die("empty forward");
    if (q.n_past + T > m.n_ctx) die("context full");
    const int n_past = q.n_past, n_kv = n_past + T;
    const auto t_start = std::chrono::steady_clock::now();
    const double c_start = cpu_now();
    const int n_out = (int) out_rows.size();
    const int n_kv_pad = std::min(m.n_ctx, (n_kv + KV_PAD - 1) / KV_PAD * KV_PAD);
    const bool share = row_shares(m, q, Bd);
    const bool taps = feats != nullptr && Tc > 0;
    const std::vector<int> key = {Tc, Bd, n_out, n_kv_pad, share, taps, exact};
    CachedGraph & G = graph_for(key, [&] { return build_graph(m, Tc, Bd, n_out, n_kv_pad, taps, exact, 0, 0, share); });
    G.share_call.segs.clear();
    for (auto & c : G.calls) c.segs.clear();
    std::vector<int32_t> ids(T), pos(T);
    std::vector<int64_t> kvi(T);
    row_columns(m, q, G, 0, commit, block, record, ids.data(), pos.data(), kvi.data());
    set_input(G.ids, ids.data(), sizeof(int32_t) * T);
    set_input(G.pos, pos.data(), sizeof(int32_t) * T);
    set_input(G.kv_idx, kvi.data(), sizeof(int64_t) * T);
    std::vector<float> mask((size_t) n_kv_pad * T, -INFINITY);  // padding: nothing
    for (int t = 0; t < T; t++) std::fill_n(&mask[(size_t) t * n_kv_pad], visible_keys(n_past, Tc, Bd, t), 0.f);
    set_mask(G.kq_mask, mask);
    std::vector<int32_t> oi(std::max(1, n_out), 0);
    for (int i = 0; i < n_out; i++) oi[i] = out_rows[i];
    set_input(G.out_ids, oi.data(), sizeof(int32_t) * oi.size());

    compute(m, G.gf, [&] { return "Tc=" + std::to_string(Tc) + " Bd=" + std::to_string(Bd) + " logits=" + std::to_string(n_out); });
    res.logits.resize((size_t) n_out * hp.n_vocab);
    if (n_out) ggml_backend_tensor_get(G.logits, res.logits.data(), 0, sizeof(float) * res.logits.size());
    if (feats) {
        feats->resize((size_t) Tc * m.dr.n_features());
        if (taps) ggml_backend_tensor_get(G.feats, feats->data(), 0, sizeof(float) * feats->size());
    }
    q.n_past += Tc;
    m.last_forward_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    m.last_forward_cpu_s = cpu_now() - c_start;
}

// ---------------------------------------------------------------------- rows in one forward
// One batched row's forward, as forward() takes it (no taps, no exact columns).
struct Sub {
    Seq * seq;
    const std::vector<int> * commit, * block, * out_rows;
    Forward * res;
    bool record;  // speculative: the commit's GDN inputs and state kept for a rollback (in the Seq)
    bool done = false;
    int tokens() const { return (int) (commit->size() + block->size()); }
};

// The forwards of several rows (each in its own cache slot, with its own GDN state) as one graph: the
// rows' columns side by side through every matmul, norm, expert and GDN op (each row's columns one
// segment of the GDN ops, over its Seq's state), and attention per row over its own slot, its
// queries gathered into [Tq, R] (R: the highest slot + 1; Tq: the longest row; the rest masked).
static void forward_batch(Model & m, std::vector<Sub *> & subs) {
    const Hparams & hp = m.hp;
    const auto t_start = std::chrono::steady_clock::now();
    const double c_start = cpu_now();
    std::sort(subs.begin(), subs.end(), [](const Sub * a, const Sub * b) { return a->seq->slot < b->seq->slot; });
    int T = 0, n_out = 0, Tq = 0, R = 0, n_kv = 0;
    bool share = false;
    for (const Sub * b : subs) {
        const int Ts = b->tokens();
        share = share || row_shares(m, *b->seq, (int) b->block->size());
        if (Ts == 0) die("empty forward");
        if (b->seq->n_past + Ts > m.n_ctx) die("context full");
        T += Ts;
        n_out += (int) b->out_rows->size();
        Tq = std::max(Tq, Ts);
        R = std::max(R, b->seq->slot + 1);
        n_kv = std::max(n_kv, b->seq->n_past + Ts);
    }
    const int n_kv_pad = std::min(m.n_ctx, (n_kv + KV_PAD - 1) / KV_PAD * KV_PAD);
    const std::vector<int> key = {-1, T, n_out, n_kv_pad, R, Tq, share};
    CachedGraph & G = graph_for(key, [&] { return build_graph(m, T, 0, n_out, n_kv_pad, false, false, R, Tq, share); });
    G.share_call.segs.clear();
    std::vector<int32_t> ids(T), pos(T), q_idx((size_t) Tq * R, 0), o_idx(T), oi(std::max(1, n_out), 0);
    std::vector<int64_t> kvi(T);
    const ggml_fp16_t NEG = ggml_fp32_to_fp16(-INFINITY), ZERO = ggml_fp32_to_fp16(0.f);
    std::vector<ggml_fp16_t> mask((size_t) n_kv_pad * Tq * R, NEG);
    for (auto & c : G.calls) c.segs.clear();
    int col = 0, out = 0;
    for (const Sub * b : subs) {
        Seq & q = *b->seq;
        const int Tc = (int) b->commit->size(), Bd = (int) b->block->size();
        row_columns(m, q, G, col, *b->commit, *b->block, b->record, ids.data(), pos.data(), kvi.data());
        for (int t = 0; t < Tc + Bd; t++) {
            q_idx[(size_t) q.slot * Tq + t] = col + t;
            o_idx[col + t] = q.slot * Tq + t;
            std::fill_n(&mask[((size_t) q.slot * Tq + t) * n_kv_pad], visible_keys(q.n_past, Tc, Bd, t), ZERO);
        }
        for (int r : *b->out_rows) oi[out++] = col + r;
        col += Tc + Bd;
    }
    set_input(G.ids, ids.data(), sizeof(int32_t) * T);
    set_input(G.pos, pos.data(), sizeof(int32_t) * T);
    set_input(G.kv_idx, kvi.data(), sizeof(int64_t) * T);
    set_input(G.kq_mask, mask.data(), sizeof(ggml_fp16_t) * mask.size());
    set_input(G.q_idx, q_idx.data(), sizeof(int32_t) * q_idx.size());
    set_input(G.o_idx, o_idx.data(), sizeof(int32_t) * T);
    set_input(G.out_ids, oi.data(), sizeof(int32_t) * oi.size());
    compute(m, G.gf, [&] { return "batch R=" + std::to_string(R) + " T=" + std::to_string(T) + " logits=" + std::to_string(n_out); });
    const size_t V = hp.n_vocab;
    out = 0;
    for (Sub * b : subs) {
        const size_t n = b->out_rows->size();
        b->res->logits.resize(n * V);
        if (n) ggml_backend_tensor_get(G.logits, b->res->logits.data(), sizeof(float) * out * V, sizeof(float) * n * V);
        out += (int) n;
        b->seq->n_past += (int) b->commit->size();
        b->seq->forwards++;
        b->seq->rows += (long) subs.size();
    }
    m.last_forward_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    m.last_forward_cpu_s = cpu_now() - c_start;
}

// --parallel N: each request decodes in a thread of its own, its loop unchanged; its forward() waits
// until every batched row in flight has asked for one, and the last to ask runs them all as one
// forward_batch. One thread runs at a time (the mutex is held by a row's host work or the batch), so
// the process uses the CPU as the unbatched one does. Rows join and leave between forwards
// (continuous batching). Speculative rows batch too (each row's rollback on its own Seq), and rows
// with block expert sharing (each row's block its own segment of the share op). Requests a batch does
// not take (dflash, block_size auto) wait for the batched rows in flight to finish and run
// alone, as without --parallel.
struct Batcher {
    std::mutex mu;
    std::condition_variable cv;
    int rows = 0, exclusive = 0;   // batched rows in flight; unbatched requests waiting or running
    std::atomic<int> joining{0};   // requests taken from the queue that have not yet started (a batch waits for them)
    std::vector<Sub *> subs;       // the forwards asked for, waiting for the batch
    std::vector<char> slot_used;   // cache slots of the rows in flight
};
static Batcher * g_batch = nullptr;
static thread_local std::unique_lock<std::mutex> * tl_lock = nullptr;  // this thread's hold on g_batch->mu

// ggml's CPU flash attention takes a tiled path, which rounds differently, for 64 or more queries per
// head and sequence (GGML_FA_TILE_Q); a batch pads every row to its longest, so rows of fewer tokens
// run in a forward of their own when a longer one is in flight (a long prompt's prefill), and each row's
// attention takes the path its one-row forward takes.
static const int FA_TILE_Q = 64;

static void batch_maybe_run(Model & m) {
    Batcher & b = *g_batch;
    if (b.rows == 0 || (int) b.subs.size() < b.rows || b.joining > 0) return;
    std::vector<Sub *> subs, shorts, longs;
    subs.swap(b.subs);
    for (Sub * x : subs) (x->tokens() >= FA_TILE_Q ? longs : shorts).push_back(x);
    if (!longs.empty() && !shorts.empty()) {
        forward_batch(m, shorts);
        forward_batch(m, longs);
    } else {
        forward_batch(m, subs);
    }
    for (Sub * x : subs) x->done = true;
    b.cv.notify_all();
}

static void batch_submit(Model & m, const std::vector<int> & commit, const std::vector<int> & block,
                         const std::vector<int> & out_rows, bool record, Forward & res) {
    Sub x{tl_seq, &commit, &block, &out_rows, &res, record};
    g_batch->subs.push_back(&x);
    batch_maybe_run(m);
    g_batch->cv.wait(*tl_lock, [&] { return x.done; });
}

// R > 0: a batched forward (forward_batch) of T = Tc tokens from the rows of cache slots [0, R), each
// row's queries gathered into [Tq, R] for attention against its own slot's first n_kv keys. share: the
// router's probabilities through the share op, the blocks that share experts set per forward in its
// segments (row_columns).
static CachedGraph * build_graph(Model & m, int Tc, int Bd, int n_out, int n_kv, bool taps, bool exact, int R, int Tq, bool share) {
    const Hparams & hp = m.hp;
    const int T = Tc + Bd;
    auto * G = new CachedGraph();
    const size_t graph_size = 8192;
    // ggml allocates the metadata buffer itself, uninitialised: a zero-filled vector of this size cost
    // 1.8 ms per graph built (page faults on 3 MB), as much as a batched q8_0 forward's matmuls' tenth
    ggml_init_params ip = {ggml_tensor_overhead() * graph_size + ggml_graph_overhead_custom(graph_size, false), nullptr, true};
    ggml_context * ctx = G->ctx = ggml_init(ip);
    ggml_cgraph * gf = G->gf = ggml_new_graph_custom(ctx, graph_size, false);

    ggml_tensor * ids = G->ids = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
    ggml_set_input(ids);
    ggml_tensor * pos = G->pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
    ggml_set_input(pos);
    ggml_tensor * kq_mask = G->kq_mask = R ? ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, Tq, 1, R)
                                           : ggml_new_tensor_2d(ctx, m.flash_attn ? GGML_TYPE_F16 : GGML_TYPE_F32, n_kv, T);
    ggml_set_input(kq_mask);
    if (R) {
        G->q_idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) Tq * R);
        ggml_set_input(G->q_idx);
        G->o_idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
        ggml_set_input(G->o_idx);
    }
    ggml_tensor * out_ids = G->out_ids = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, std::max(1, n_out));
    ggml_set_input(out_ids);
    ggml_tensor * kv_idx = G->kv_idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, T);  // the cache rows written
    ggml_set_input(kv_idx);

    std::vector<GdnCall> & calls = G->calls;
    calls.resize(hp.n_layer);
    ShareCall & share_call = G->share_call;
    share_call.segs.clear();
    // the grouped op where the experts get MOE_GEMM_MIN tokens on average; below, mul_mat_id's row
    // dots do the same arithmetic without the op's gathering (5-10% of a q8_0 forward of 8 tokens)
    const bool grouped = m.moe_grouped && !exact && (int64_t) T * hp.n_expert_used >= (int64_t) MOE_GEMM_MIN * hp.n_expert;
    G->moe_calls.resize(hp.n_layer);
    // q8_0 matmuls by the wide kernel (packed at load): each column bit for bit as vec_dot computes
    // it, so AR steps and exact forwards take it too
    const bool wide = m.wide;
    // exact: every weight matmul computes each column as a one-token forward does. ggml multiplies one
    // column by vec_dot and two or more by tinyBLAS, whose sums round differently; columns given as
    // [K, 1, T] (a broadcast batch of one-column products) keep vec_dot, so a dflash verify gives AR's
    // logits bit for bit (f32 and q8_0), at the cost of the row dots (the routed experts run so anyway)
    auto mm = [&](ggml_tensor * w, ggml_tensor * a) -> ggml_tensor * {
        if (const PackedQ8 * p = wide ? packed_of(w) : nullptr; p && p->E == 1 && ggml_is_contiguous(a)) {
            ggml_tensor * y = ggml_custom_4d(ctx, GGML_TYPE_F32, p->R, a->ne[1], 1, 1, &a, 1, q8_dense, GGML_N_TASKS_MAX, (void *) p);
            return ggml_set_name(y, w->name);
        }
        if (!exact || a->ne[1] < 2) return ggml_mul_mat(ctx, w, a);
        const int64_t n = a->ne[1];
        if (!ggml_is_contiguous(a)) a = ggml_cont(ctx, a);
        ggml_tensor * r = ggml_mul_mat(ctx, w, ggml_reshape_3d(ctx, a, a->ne[0], 1, n));
        return ggml_reshape_2d(ctx, r, r->ne[0], n);
    };
    ggml_tensor * x = ggml_get_rows(ctx, m.tok_embd, ids);  // [H, T]
    const int H = hp.n_embd, hd = hp.head_dim, nh = hp.n_head, nkv = hp.n_head_kv;
    std::vector<ggml_tensor *> tapped(hp.n_layer, nullptr);
    for (int il = 0; il < hp.n_layer; il++) {
        Layer & L = m.layers[il];
        ggml_tensor * cur = ggml_mul(ctx, ggml_rms_norm(ctx, x, hp.eps), L.attn_norm);
        if (L.recurrent) {
            ggml_tensor * mixed = mm(L.wqkv, cur);    // [C, T]
            ggml_tensor * z = mm(L.wgate, cur);       // [Hv*dv, T]
            ggml_tensor * al = mm(L.walpha, cur);     // [Hv, T]
            ggml_tensor * be = mm(L.wbeta, cur);      // [Hv, T]
            calls[il] = {&m, &L, {}};
            ggml_tensor * pre = ggml_custom_4d(ctx, GGML_TYPE_F32, hp.conv_dim(), T, 1, 1, &mixed, 1, m.gdn_fast ? gdn_conv_fast : gdn_conv,
                                               GGML_N_TASKS_MAX, &calls[il]);
            ggml_set_name(pre, "gdn_conv");
            ggml_tensor * args[3] = {ggml_silu(ctx, pre), al, be};
            ggml_tensor * o = ggml_custom_4d(ctx, GGML_TYPE_F32, hp.dv, hp.hv, T, 1, args, 3, gdn_mix, GGML_N_TASKS_MAX, &calls[il]);
            ggml_set_name(o, "gdn_mix");
            ggml_tensor * z3 = ggml_reshape_3d(ctx, z, hp.dv, hp.hv, T);
            o = ggml_swiglu_split(ctx, z3, ggml_mul(ctx, ggml_rms_norm(ctx, o, hp.eps), L.ssm_norm));  // silu(z) * norm(o)
            cur = mm(L.ssm_out, ggml_reshape_2d(ctx, o, hp.dv * hp.hv, T));
        } else {
            ggml_tensor * qf = mm(L.wq, cur);  // [2*hd*nh, T], per head [query | gate]
            const size_t es = ggml_element_size(qf);
            ggml_tensor * q = ggml_view_3d(ctx, qf, hd, nh, T, es * hd * 2, es * hd * 2 * nh, 0);
            ggml_tensor * gate = ggml_view_3d(ctx, qf, hd, nh, T, es * hd * 2, es * hd * 2 * nh, es * hd);
            gate = ggml_cont_2d(ctx, gate, hd * nh, T);
            q = ggml_mul(ctx, ggml_rms_norm(ctx, q, hp.eps), L.q_norm);
            ggml_tensor * k = ggml_reshape_3d(ctx, mm(L.wk, cur), hd, nkv, T);
            k = ggml_mul(ctx, ggml_rms_norm(ctx, k, hp.eps), L.k_norm);
            ggml_tensor * v = ggml_reshape_3d(ctx, mm(L.wv, cur), hd, nkv, T);
            q = ggml_rope_ext(ctx, q, pos, nullptr, hp.n_rot, GGML_ROPE_TYPE_NEOX, 0, hp.rope_base, 1.f, 0.f, 1.f, 0.f, 0.f);
            k = ggml_rope_ext(ctx, k, pos, nullptr, hp.n_rot, GGML_ROPE_TYPE_NEOX, 0, hp.rope_base, 1.f, 0.f, 1.f, 0.f, 0.f);
            // all T new K/V go into the cache at [n_past, n_past + T): the commit part becomes prefix,
            // the block part is scratch that the next commit overwrites (never read past this forward:
            // every later query's keys end at its own forward's last position). The copies are expanded
            // first, so they run before the attention reads the cache view.
            ggml_tensor * k_rows = ggml_reshape_2d(ctx, L.k_cache, hd * nkv, L.k_cache->ne[2]);
            ggml_tensor * v_rows = ggml_reshape_2d(ctx, L.v_cache, hd * nkv, L.v_cache->ne[2]);
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, k_rows, ggml_reshape_2d(ctx, k, hd * nkv, T), kv_idx));
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, v_rows, ggml_reshape_2d(ctx, v, hd * nkv, T), kv_idx));
            ggml_tensor * att;
            if (R) {  // each row's queries against its own slot: [hd, Tq, nh, R] x [hd, n_kv, nkv, R]
                const size_t slot = L.k_cache->nb[2] * (size_t) m.n_ctx, vslot = L.v_cache->nb[2] * (size_t) m.n_ctx;
                ggml_tensor * K = ggml_view_4d(ctx, L.k_cache, hd, nkv, n_kv, R, L.k_cache->nb[1], L.k_cache->nb[2], slot, 0);
                ggml_tensor * V = ggml_view_4d(ctx, L.v_cache, hd, nkv, n_kv, R, L.v_cache->nb[1], L.v_cache->nb[2], vslot, 0);
                ggml_tensor * Q = ggml_get_rows(ctx, ggml_reshape_2d(ctx, q, hd * nh, T), G->q_idx);  // [hd*nh, Tq*R]
                Q = ggml_permute(ctx, ggml_reshape_4d(ctx, Q, hd, nh, Tq, R), 0, 2, 1, 3);
                att = ggml_flash_attn_ext(ctx, Q, ggml_permute(ctx, K, 0, 2, 1, 3), ggml_permute(ctx, V, 0, 2, 1, 3), kq_mask,
                                          1.f / sqrtf((float) hd), 0.f, 0.f);  // [hd, nh, Tq, R]
                att = ggml_get_rows(ctx, ggml_reshape_2d(ctx, att, hd * nh, (int64_t) Tq * R), G->o_idx);  // [hd*nh, T]
            } else if (m.flash_attn) {  // V read as stored: no transposed copy
                ggml_tensor * K = ggml_view_3d(ctx, L.k_cache, hd, nkv, n_kv, L.k_cache->nb[1], L.k_cache->nb[2], 0);
                ggml_tensor * V = ggml_view_3d(ctx, L.v_cache, hd, nkv, n_kv, L.v_cache->nb[1], L.v_cache->nb[2], 0);
                ggml_tensor * Kp = ggml_permute(ctx, K, 0, 2, 1, 3);              // [hd, n_kv, nkv]
                ggml_tensor * Q = ggml_permute(ctx, q, 0, 2, 1, 3);               // [hd, T, nh]
                ggml_tensor * Vp = ggml_permute(ctx, V, 0, 2, 1, 3);              // [hd, n_kv, nkv]
                att = ggml_flash_attn_ext(ctx, Q, Kp, Vp, kq_mask, 1.f / sqrtf((float) hd), 0.f, 0.f);  // [hd, nh, T]
                att = ggml_reshape_2d(ctx, att, hd * nh, T);
            } else {
                ggml_tensor * K = ggml_view_3d(ctx, L.k_cache, hd, nkv, n_kv, L.k_cache->nb[1], L.k_cache->nb[2], 0);
                ggml_tensor * V = ggml_view_3d(ctx, L.v_cache, hd, nkv, n_kv, L.v_cache->nb[1], L.v_cache->nb[2], 0);
                ggml_tensor * Kp = ggml_permute(ctx, K, 0, 2, 1, 3);                  // [hd, n_kv, nkv]
                ggml_tensor * Q = ggml_permute(ctx, q, 0, 2, 1, 3);                   // [hd, T, nh]
                ggml_tensor * Vt = ggml_cont(ctx, ggml_permute(ctx, V, 1, 2, 0, 3));   // [n_kv, hd, nkv]
                ggml_tensor * kq = ggml_mul_mat(ctx, Kp, Q);                          // [n_kv, T, nh]
                kq = ggml_soft_max_ext(ctx, kq, kq_mask, 1.f / sqrtf((float) hd), 0.f);
                ggml_tensor * kqv = ggml_mul_mat(ctx, Vt, kq);                        // [hd, T, nh]
                att = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), hd * nh, T);
            }
            att = ggml_mul(ctx, att, ggml_sigmoid(ctx, gate));
            cur = mm(L.wo, att);
        }
        x = ggml_add(ctx, x, cur);
        // MoE: softmax router -> top-k -> renormalised; plus the sigmoid-gated shared expert
        ggml_tensor * h = ggml_mul(ctx, ggml_rms_norm(ctx, x, hp.eps), L.post_norm);
        const int E = hp.n_expert, k = hp.n_expert_used;
        ggml_tensor * probs = ggml_soft_max(ctx, mm(L.gate_inp, h));  // [E, T]
        if (share) probs = ggml_set_name(ggml_custom_4d(ctx, GGML_TYPE_F32, E, T, 1, 1, &probs, 1, block_share, 1, &share_call), "block_share");
        ggml_tensor * sel = ggml_top_k(ctx, probs, k);                               // [k, T]
        ggml_tensor * wts = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, E, T), sel);  // [1, k, T]
        wts = ggml_reshape_2d(ctx, wts, k, T);
        wts = ggml_div(ctx, wts, ggml_sum_rows(ctx, wts));
        wts = ggml_reshape_3d(ctx, wts, 1, k, T);
        ggml_tensor * dn;  // [H, k, T]: each slot's expert FFN
        const PackedQ8 * pg = wide ? packed_of(L.gate_exps) : nullptr, * pu = wide ? packed_of(L.up_exps) : nullptr,
                       * pd = wide ? packed_of(L.down_exps) : nullptr;
        if (pg && pu && pd && ggml_is_contiguous(h)) {  // mul_mat_id's graph with the wide kernel
            auto mm_id = [&](const PackedQ8 * p, ggml_tensor * w, ggml_tensor * b) {
                ggml_tensor * args[2] = {b, sel};
                return ggml_set_name(ggml_custom_4d(ctx, GGML_TYPE_F32, p->R, k, T, 1, args, 2, q8_mul_mat_id, GGML_N_TASKS_MAX, (void *) p), w->name);
            };
            ggml_tensor * h3 = ggml_reshape_3d(ctx, h, H, 1, T);
            ggml_tensor * up = mm_id(pu, L.up_exps, h3);      // [I, k, T]
            ggml_tensor * gt = mm_id(pg, L.gate_exps, h3);
            dn = mm_id(pd, L.down_exps, ggml_swiglu_split(ctx, gt, up));
        } else if (grouped) {
            G->moe_calls[il] = {&L, &expert_workers(m.n_threads)};
            ggml_tensor * args[2] = {h, sel};
            dn = ggml_custom_4d(ctx, GGML_TYPE_F32, H, k, T, 1, args, 2, moe_grouped, GGML_N_TASKS_MAX, &G->moe_calls[il]);
            ggml_set_name(dn, "moe_grouped");
        } else {
            ggml_tensor * h3 = ggml_reshape_3d(ctx, h, H, 1, T);
            ggml_tensor * up = ggml_mul_mat_id(ctx, L.up_exps, h3, sel);      // [I, k, T]
            ggml_tensor * gt = ggml_mul_mat_id(ctx, L.gate_exps, h3, sel);
            ggml_tensor * par = ggml_swiglu_split(ctx, gt, up);
            dn = ggml_mul_mat_id(ctx, L.down_exps, par, sel);
        }
        ggml_tensor * sh = mm(L.down_shexp, ggml_swiglu_split(ctx, mm(L.gate_shexp, h), mm(L.up_shexp, h)));
        ggml_tensor * sg = ggml_sigmoid(ctx, mm(L.gate_inp_shexp, h));  // [1, T]
        ggml_tensor * margs[4] = {dn, wts, sh, sg};
        x = ggml_add(ctx, x, ggml_set_name(ggml_custom_4d(ctx, GGML_TYPE_F32, H, T, 1, 1, margs, 4, moe_combine, GGML_N_TASKS_MAX, nullptr), "moe_combine"));
        if (taps) tapped[il] = x;
    }
    if (taps) {  // the drafter's context input (DFlashDrafter.context_features): the tapped layers' outputs
        ggml_tensor * f = nullptr;  // of the commit tokens, concatenated; the last layer's after the final norm
        for (int il : m.dr.target_layers) {
            ggml_tensor * h = tapped[il];
            if (Bd) h = ggml_cont(ctx, ggml_view_2d(ctx, h, H, Tc, h->nb[1], 0));
            if (il == hp.n_layer - 1) h = ggml_mul(ctx, ggml_rms_norm(ctx, h, hp.eps), m.out_norm);
            f = f ? ggml_concat(ctx, f, h, 0) : h;
        }
        G->feats = f;
        ggml_set_output(f);
        ggml_build_forward_expand(gf, f);
    }
    if (n_out) {
        ggml_tensor * xo = ggml_get_rows(ctx, x, out_ids);
        xo = ggml_mul(ctx, ggml_rms_norm(ctx, xo, hp.eps), m.out_norm);
        G->logits = mm(m.output, xo);
        ggml_set_output(G->logits);
        ggml_build_forward_expand(gf, G->logits);
    } else {
        ggml_set_output(x);
        ggml_build_forward_expand(gf, x);
    }
    G->galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(m.backend));
    if (!ggml_gallocr_alloc_graph(G->galloc, gf)) die("graph allocation failed");
    return G;
}

// Roll the commit of this thread's row's last forward (one that recorded) back to its first `keep`
// tokens (speculative partial accept).
static void rollback(Model & m, int committed, int keep) {
    const Hparams & hp = m.hp;
    const int K1 = hp.conv_k - 1, C = hp.conv_dim(), dk = hp.dk, dv = hp.dv;
    Seq & sq = row_of(m);
    sq.n_past -= committed - keep;
    std::vector<float> q(dk), k(dk), kv(dv);
    for (int il = 0; il < hp.n_layer; il++) {
        const Layer & L = m.layers[il];
        if (!L.recurrent) continue;
        std::vector<float> & S = sq.S[il], & conv = sq.conv[il];
        const std::vector<float> & S0 = sq.S0[il], & rec = sq.rec[il], & window = sq.window[il];
        const int rec_T = sq.rec_T, W = sq.window_len;
        // S: the state before the commit, advanced by exactly the kept tokens (the forward's own code)
        S = S0;
        const size_t hs = (size_t) dk * dv, rw = (size_t) 2 * dk + dv + 2;
        for (int h = 0; h < hp.hv; h++)
            for (int t = 0; t < keep; t++) {
                const float * r = &rec[((size_t) h * rec_T + t) * rw];
                commit_step(m.gdn_fast, hp, L, h, &S[(size_t) h * hs], r, r + dk, r + 2 * dk, r[2 * dk + dv], r[2 * dk + dv + 1],
                            nullptr, q.data(), k.data(), kv.data());
            }
        // conv state: the last K-1 inputs up to the last kept token
        for (int ch = 0; ch < C; ch++)
            for (int j = 0; j < K1; j++) conv[(size_t) ch * K1 + j] = window[(size_t) ch * W + keep + j];
    }
}

// ---------------------------------------------------------------------------- the DFlash draft
// One drafter forward (DFlashDrafter.draft): the context features of the Tc tokens committed since
// the last draft [F, Tc] -> fc + hidden_norm -> per drafter layer their K/V (k_norm, RoPE at the
// token's position), written into the drafter's cache; the block (anchor + masks, embedded with the
// target's embedding) attends to every context key and bidirectionally to itself (its own K/V are
// written after the context's as scratch, never read by a later draft: the next context overwrites
// them); then the final norm and the target's LM head on block positions 1.. (no shift). As the
// target's graphs, one graph per shape (Tc, Bd, padded key length), its inputs set per draft.
struct DraftGraph {
    ggml_context * ctx = nullptr;
    ggml_cgraph * gf = nullptr;
    ggml_gallocr_t galloc = nullptr;
    ggml_tensor *feats = nullptr, *ids = nullptr, *pos_c = nullptr, *pos_b = nullptr, *kv_c = nullptr, *kv_b = nullptr;
    ggml_tensor *kq_mask = nullptr, *out_ids = nullptr, *logits = nullptr;
    uint64_t used = 0;
    ~DraftGraph() {
        if (galloc) ggml_gallocr_free(galloc);
        if (ctx) ggml_free(ctx);
    }
};

static std::map<std::vector<int>, std::unique_ptr<DraftGraph>> & draft_graph_cache() {
    static std::map<std::vector<int>, std::unique_ptr<DraftGraph>> graphs;
    return graphs;
}

static DraftGraph * build_draft_graph(Model & m, int Tc, int Bd, int n_kv) {
    const Drafter & d = m.dr;
    auto * G = new DraftGraph();
    const size_t graph_size = 2048;
    // ggml allocates the metadata buffer itself, uninitialised: a zero-filled vector of this size cost
    // 1.8 ms per graph built (page faults on 3 MB), as much as a batched q8_0 forward's matmuls' tenth
    ggml_init_params ip = {ggml_tensor_overhead() * graph_size + ggml_graph_overhead_custom(graph_size, false), nullptr, true};
    ggml_context * ctx = G->ctx = ggml_init(ip);
    ggml_cgraph * gf = G->gf = ggml_new_graph_custom(ctx, graph_size, false);
    const int hd = d.head_dim, nh = d.n_head, nkv = d.n_head_kv, no = Bd - 1;
    auto input = [&](ggml_type type, int64_t n0, int64_t n1 = 1) {
        ggml_tensor * t = n1 == 1 ? ggml_new_tensor_1d(ctx, type, n0) : ggml_new_tensor_2d(ctx, type, n0, n1);
        ggml_set_input(t);
        return t;
    };
    G->ids = input(GGML_TYPE_I32, Bd);
    G->pos_b = input(GGML_TYPE_I32, Bd);
    G->kv_b = input(GGML_TYPE_I64, Bd);
    G->kq_mask = input(m.flash_attn ? GGML_TYPE_F16 : GGML_TYPE_F32, n_kv, Bd);
    G->out_ids = input(GGML_TYPE_I32, no);
    ggml_tensor * c = nullptr;
    if (Tc) {
        G->feats = input(GGML_TYPE_F32, d.n_features(), Tc);
        G->pos_c = input(GGML_TYPE_I32, Tc);
        G->kv_c = input(GGML_TYPE_I64, Tc);
        c = ggml_mul(ctx, ggml_rms_norm(ctx, ggml_mul_mat(ctx, d.fc, G->feats), d.eps), d.hidden_norm);  // [H, Tc]
    }
    auto rope = [&](ggml_tensor * t, ggml_tensor * pos) {  // rotate-half over the whole head (NeoX)
        return ggml_rope_ext(ctx, t, pos, nullptr, hd, GGML_ROPE_TYPE_NEOX, 0, d.rope_base, 1.f, 0.f, 1.f, 0.f, 0.f);
    };
    auto norm = [&](ggml_tensor * t, ggml_tensor * w) { return ggml_mul(ctx, ggml_rms_norm(ctx, t, d.eps), w); };
    ggml_tensor * x = ggml_get_rows(ctx, m.tok_embd, G->ids);  // [H, Bd]: the target's embedding
    if (d.embd_scale != 1.f) x = ggml_scale(ctx, x, d.embd_scale);
    for (const DraftLayer & L : d.layers) {
        ggml_tensor * k_rows = ggml_reshape_2d(ctx, L.k_cache, hd * nkv, L.k_cache->ne[2]);
        ggml_tensor * v_rows = ggml_reshape_2d(ctx, L.v_cache, hd * nkv, L.v_cache->ne[2]);
        if (Tc) {  // the context's keys and values (DraftAttention.kv), into the cache
            ggml_tensor * k = rope(norm(ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L.wk, c), hd, nkv, Tc), L.k_norm), G->pos_c);
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, k_rows, ggml_reshape_2d(ctx, k, hd * nkv, Tc), G->kv_c));
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, v_rows, ggml_mul_mat(ctx, L.wv, c), G->kv_c));
        }
        ggml_tensor * h = norm(x, L.attn_norm);
        ggml_tensor * q = rope(norm(ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L.wq, h), hd, nh, Bd), L.q_norm), G->pos_b);
        ggml_tensor * k = rope(norm(ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L.wk, h), hd, nkv, Bd), L.k_norm), G->pos_b);
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, k_rows, ggml_reshape_2d(ctx, k, hd * nkv, Bd), G->kv_b));
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, v_rows, ggml_mul_mat(ctx, L.wv, h), G->kv_b));
        ggml_tensor * K = ggml_view_3d(ctx, L.k_cache, hd, nkv, n_kv, L.k_cache->nb[1], L.k_cache->nb[2], 0);
        ggml_tensor * V = ggml_view_3d(ctx, L.v_cache, hd, nkv, n_kv, L.v_cache->nb[1], L.v_cache->nb[2], 0);
        ggml_tensor * Kp = ggml_permute(ctx, K, 0, 2, 1, 3);  // [hd, n_kv, nkv]
        ggml_tensor * Q = ggml_permute(ctx, q, 0, 2, 1, 3);   // [hd, Bd, nh]
        ggml_tensor * att;
        if (m.flash_attn) {
            att = ggml_flash_attn_ext(ctx, Q, Kp, ggml_permute(ctx, V, 0, 2, 1, 3), G->kq_mask, 1.f / sqrtf((float) hd), 0.f, 0.f);
            att = ggml_reshape_2d(ctx, att, hd * nh, Bd);
        } else {
            ggml_tensor * Vt = ggml_cont(ctx, ggml_permute(ctx, V, 1, 2, 0, 3));  // [n_kv, hd, nkv]
            ggml_tensor * kq = ggml_soft_max_ext(ctx, ggml_mul_mat(ctx, Kp, Q), G->kq_mask, 1.f / sqrtf((float) hd), 0.f);
            att = ggml_cont_2d(ctx, ggml_permute(ctx, ggml_mul_mat(ctx, Vt, kq), 0, 2, 1, 3), hd * nh, Bd);
        }
        x = ggml_add(ctx, x, ggml_mul_mat(ctx, L.wo, att));
        ggml_tensor * h2 = norm(x, L.ffn_norm);
        x = ggml_add(ctx, x, ggml_mul_mat(ctx, L.down, ggml_swiglu_split(ctx, ggml_mul_mat(ctx, L.gate, h2), ggml_mul_mat(ctx, L.up, h2))));
    }
    ggml_tensor * lg = ggml_mul_mat(ctx, m.output, norm(ggml_get_rows(ctx, x, G->out_ids), d.out_norm));  // [V, Bd-1]
    if (d.out_mult != 1.f) lg = ggml_scale(ctx, lg, d.out_mult);
    if (d.softcap != 0.f) lg = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, lg, 1.f / d.softcap)), d.softcap);
    G->logits = lg;
    ggml_set_output(lg);
    ggml_build_forward_expand(gf, lg);
    G->galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(m.backend));
    if (!ggml_gallocr_alloc_graph(G->galloc, gf)) die("drafter graph allocation failed");
    return G;
}

// The draft: `feats` [Tc][F] the context features not yet in the drafter's cache (appended to it),
// `block` the anchor and the masks -> logits [Bd-1][V] of block positions 1..Bd-1.
static void draft_forward(Model & m, const std::vector<float> & feats, const std::vector<int> & block, std::vector<float> & logits) {
    Drafter & d = m.dr;
    const int F = d.n_features(), Tc = (int) (feats.size() / F), Bd = (int) block.size(), V = m.hp.n_vocab;
    const int n0 = d.n_past, n_kv = n0 + Tc + Bd;
    if (n_kv > m.n_ctx) die("context full (drafter)");
    const int n_kv_pad = std::min(m.n_ctx, (n_kv + KV_PAD - 1) / KV_PAD * KV_PAD);
    auto & graphs = draft_graph_cache();
    static uint64_t tick = 0;
    const std::vector<int> key = {Tc, Bd, n_kv_pad};
    auto it = graphs.find(key);
    if (it == graphs.end()) {
        if (graphs.size() >= 24) {
            auto old = graphs.begin();
            for (auto g = graphs.begin(); g != graphs.end(); ++g) if (g->second->used < old->second->used) old = g;
            graphs.erase(old);
        }
        it = graphs.emplace(key, std::unique_ptr<DraftGraph>(build_draft_graph(m, Tc, Bd, n_kv_pad))).first;
    }
    DraftGraph & G = *it->second;
    G.used = ++tick;
    const double c0 = cpu_now();
    std::vector<int32_t> i32(std::max(Tc, Bd));
    std::vector<int64_t> i64(std::max(Tc, Bd));
    if (Tc) {
        set_input(G.feats, feats.data(), sizeof(float) * feats.size());
        for (int t = 0; t < Tc; t++) { i32[t] = n0 + t; i64[t] = n0 + t; }
        set_input(G.pos_c, i32.data(), sizeof(int32_t) * Tc);
        set_input(G.kv_c, i64.data(), sizeof(int64_t) * Tc);
    }
    set_input(G.ids, block.data(), sizeof(int32_t) * Bd);
    for (int t = 0; t < Bd; t++) { i32[t] = n0 + Tc + t; i64[t] = n0 + Tc + t; }
    set_input(G.pos_b, i32.data(), sizeof(int32_t) * Bd);
    set_input(G.kv_b, i64.data(), sizeof(int64_t) * Bd);
    std::vector<float> mask((size_t) n_kv_pad * Bd);
    for (int t = 0; t < Bd; t++)
        for (int j = 0; j < n_kv_pad; j++) mask[(size_t) t * n_kv_pad + j] = j < n_kv ? 0.f : -INFINITY;
    set_mask(G.kq_mask, mask);
    for (int t = 0; t < Bd - 1; t++) i32[t] = t + 1;
    set_input(G.out_ids, i32.data(), sizeof(int32_t) * (Bd - 1));
    compute(m, G.gf, [&] { return "dflash draft: context " + std::to_string(Tc) + " Bd=" + std::to_string(Bd); });
    logits.resize((size_t) (Bd - 1) * V);
    ggml_backend_tensor_get(G.logits, logits.data(), 0, sizeof(float) * logits.size());
    d.n_past += Tc;
    d.cpu_s += cpu_now() - c0;
}

static void clear_graphs() {  // their views point into the cache
    graph_cache().clear();
    draft_graph_cache().clear();
}

// ------------------------------------------------------------------------------- decoding options
using json = nlohmann::json;

// One request's options: clover's SamplingParams (the same names in a JSON request), the model's
// defaults filled in as clover's resolve_params does.
struct Params {
    std::string mode = "diffusion";
    int max_new = 64, block = -1, draft = -1;
    float threshold = -1.f;
    std::string policy;  // "": the model's (the threshold rule when only a threshold is given)
    float entropy_budget = 1.0f, factor = 1.0f, low_threshold = 0.5f;
    std::string fallback = "confident", confidence = "prob";
    float temperature = 0.f, top_p = 1.f;
    int top_k = 0;
    bool seeded = false;
    uint64_t seed = 0;
    float repetition_penalty = 1.f, presence_penalty = 0.f, eos_penalty = 0.f;
    int no_repeat_ngram_size = 0, sub_block = 0, expert_budget = -1;  // expert_budget -1: the model's
    bool draft_given = false;  // draft_length was set (dflash: a fixed draft, no confidence cut)
    bool auto_width = false;   // block_size "auto": each block's width chosen (diffusion, WidthPolicy) or draft's (DraftPolicy)
    std::string expert_rank = "sum";
    std::vector<std::pair<int, float>> logit_bias;  // token id -> added to its logit (OpenAI's logit_bias)
    bool ignore_eos = false, stream = false;
    std::set<int> eos, stop_ids;
    std::vector<std::string> stop;               // stop strings (UTF-8)
    const std::vector<std::string> * pieces = nullptr;  // each token's bytes (`token_pieces`)
    bool greedy() const { return temperature == 0.f; }
    bool uses_history() const { return repetition_penalty != 1.f || presence_penalty != 0.f || no_repeat_ngram_size > 0; }
};

static const std::set<std::string> POLICIES = {"threshold", "entropy", "factor", "hierarchy"};

static std::string choice(const json & v, const std::string & key, const std::set<std::string> & allowed) {
    const std::string s = v.get<std::string>();
    if (!allowed.count(s)) {
        std::string all;
        for (const std::string & a : allowed) all += (all.empty() ? "" : ", ") + a;
        throw std::runtime_error(key + ": must be one of " + all + ", got '" + s + "'");
    }
    return s;
}

static std::set<int> id_set(const json & v) {
    std::set<int> out;
    for (const auto & x : v) out.insert(x.get<int>());
    return out;
}

// One option of a request (the JSON names are clover's SamplingParams fields).
static void set_option(Params & p, const std::string & k, const json & v) {
    try {
        if (k == "mode") p.mode = choice(v, k, {"ar", "diffusion", "speculative", "dflash"});
        else if (k == "max_new_tokens") p.max_new = v.get<int>();
        else if (k == "block_size" && v.is_string()) {
            if (v.get<std::string>() != "auto") throw std::runtime_error("block_size: a number or \"auto\", got " + v.dump());
            p.auto_width = true;
            p.block = -1;
        } else if (k == "block_size") { p.block = v.is_null() ? -1 : v.get<int>(); p.auto_width = false; }
        else if (k == "draft_length") p.draft = v.is_null() ? -1 : v.get<int>();
        else if (k == "threshold") p.threshold = v.is_null() ? -1.f : v.get<float>();
        else if (k == "policy") p.policy = v.is_null() ? "" : choice(v, k, POLICIES);
        else if (k == "entropy_budget") p.entropy_budget = v.get<float>();
        else if (k == "factor") p.factor = v.get<float>();
        else if (k == "low_threshold") p.low_threshold = v.get<float>();
        else if (k == "fallback") p.fallback = choice(v, k, {"confident", "leftmost"});
        else if (k == "confidence") p.confidence = choice(v, k, {"prob", "margin", "entropy"});
        else if (k == "temperature") p.temperature = v.get<float>();
        else if (k == "top_p") p.top_p = v.get<float>();
        else if (k == "top_k") p.top_k = std::max(0, v.get<int>());
        else if (k == "seed") { p.seeded = !v.is_null(); if (p.seeded) p.seed = v.get<uint64_t>(); }
        else if (k == "repetition_penalty") p.repetition_penalty = v.get<float>();
        else if (k == "presence_penalty") p.presence_penalty = v.get<float>();
        else if (k == "eos_penalty") p.eos_penalty = v.get<float>();
        else if (k == "no_repeat_ngram_size") p.no_repeat_ngram_size = v.get<int>();
        else if (k == "sub_block") p.sub_block = v.is_null() ? 0 : v.get<int>();
        else if (k == "expert_budget") p.expert_budget = v.is_null() ? -1 : v.get<int>();
        else if (k == "expert_rank") p.expert_rank = choice(v, k, {"sum", "max"});
        else if (k == "logit_bias") {
            p.logit_bias.clear();
            if (!v.is_null())
                for (auto it = v.begin(); it != v.end(); ++it) p.logit_bias.push_back({std::stoi(it.key()), it.value().get<float>()});
        } else if (k == "ignore_eos") p.ignore_eos = v.get<bool>();
        else if (k == "stream") p.stream = v.get<bool>();
        else if (k == "eos_token_ids") p.eos = id_set(v);
        else if (k == "stop_token_ids") p.stop_ids = id_set(v);
        else if (k == "stop") {
            p.stop.clear();
            if (v.is_string()) p.stop.push_back(v.get<std::string>());
            else if (!v.is_null()) for (const auto & x : v) p.stop.push_back(x.get<std::string>());
            p.stop.erase(std::remove(p.stop.begin(), p.stop.end(), std::string()), p.stop.end());
        } else throw std::runtime_error(k + ": unknown option");
    } catch (const std::invalid_argument &) {
        throw std::runtime_error(k + ": keys must be token ids, got " + v.dump());
    } catch (const json::exception &) {
        throw std::runtime_error(k + ": wrong type, got " + v.dump());
    }
}

static const std::set<std::string> REQUEST_KEYS = {"id", "prompt", "messages", "add_generation_prompt"};

static std::vector<int> auto_widths(const Model & m, const std::string & mode);

// The request's options over the command line's, with the model's defaults (resolve_params).
static Params make_params(const Model & m, const json & defaults, const json & req) {
    Params p;
    json all = defaults;
    for (auto it = req.begin(); it != req.end(); ++it)
        if (!REQUEST_KEYS.count(it.key())) all[it.key()] = it.value();
    bool eos_given = false, threshold_given = false;
    for (auto it = all.begin(); it != all.end(); ++it) {
        set_option(p, it.key(), it.value());
        eos_given |= it.key() == "eos_token_ids";
        threshold_given |= it.key() == "threshold" && !it.value().is_null();
    }
    const Hparams & hp = m.hp;
    auto bad = [](const std::string & s) { throw std::runtime_error(s); };
    if (p.auto_width && p.mode == "diffusion") p.block = auto_widths(m, p.mode).back();  // the widest it may choose (the cache's room)
    if (p.auto_width && (p.mode == "speculative" || p.mode == "dflash")) {
        if (p.draft > 0) bad("draft_length: block_size \"auto\" chooses the draft length; give one or the other");
        const std::vector<int> w = auto_widths(m, p.mode);  // the widest it may choose (the cache's room)
        p.block = p.mode == "dflash" ? hp.block_size : w.back();
        p.draft = p.mode == "dflash" ? w.back() - 1 : w.back();
    }
    if (p.block <= 0) p.block = hp.block_size;
    p.draft_given = p.draft > 0 && !p.auto_width;
    if (p.draft <= 0) p.draft = p.block;
    if (p.policy.empty()) p.policy = threshold_given ? "threshold" : hp.policy;
    if (p.threshold <= 0) p.threshold = hp.threshold;
    if (p.expert_budget < 0) p.expert_budget = hp.expert_budget;
    if (!eos_given && hp.eos_id >= 0) p.eos.insert(hp.eos_id);
    p.pieces = &m.pieces;
    if (p.max_new < 0) bad("max_new_tokens: must be >= 0");
    if (p.temperature < 0) bad("temperature: must be >= 0");
    if (!(p.top_p > 0 && p.top_p <= 1)) bad("top_p: must be > 0 and <= 1");
    if (p.repetition_penalty <= 0) bad("repetition_penalty: must be > 0");
    if (p.no_repeat_ngram_size < 0) bad("no_repeat_ngram_size: must be >= 0");
    if (p.block < 1) bad("block_size: must be >= 1");
    if (p.expert_budget > 0 && (p.expert_budget < hp.n_expert_used || p.expert_budget > hp.n_expert))
        bad("expert_budget: must lie in [" + std::to_string(hp.n_expert_used) + ", " + std::to_string(hp.n_expert) + "]");
    if (p.policy == "hierarchy" && p.low_threshold > p.threshold) bad("low_threshold: must be <= threshold");
    for (int t : p.stop_ids) if (t < 0 || t >= hp.n_vocab) bad("stop_token_ids: " + std::to_string(t) + " is outside the vocabulary");
    for (const auto & b : p.logit_bias) if (b.first < 0 || b.first >= hp.n_vocab) bad("logit_bias: token id " + std::to_string(b.first) + " is outside the vocabulary");
    if (!p.stop.empty() && m.pieces.empty()) bad("stop: needs the GGUF's tokenizer.ggml.tokens");
    if (p.mode == "speculative") {  // speculative.check_speculative_params
        if (!p.greedy()) bad("temperature: sampled speculative decoding (the rejection rule) is not in the llama.cpp port; use temperature 0, or mode ar or diffusion to sample");
        if (p.uses_history()) bad("repetition_penalty: history-dependent penalties are not supported in speculative mode");
        if (p.draft > p.block) bad("draft_length: must be <= block_size (" + std::to_string(p.block) + ")");
    }
    if (p.mode == "dflash") {  // DFlash.make_engine / DFlashEngine
        if (!m.dr.loaded) bad("mode: 'dflash' needs a DFlash drafter: --drafter FILE (`clover export-gguf DRAFTER_DIR FILE`)");
        if (!p.greedy()) bad("temperature: sampled dflash decoding (the rejection rule) is not in the llama.cpp port; use temperature 0, or mode ar or diffusion to sample");
        const int bs = m.dr.block_size;
        if (p.draft_given && !(p.draft >= 1 && p.draft <= bs - 1))
            bad("draft_length: must lie in [1, " + std::to_string(bs - 1) + "] for this drafter (block_size " + std::to_string(bs) + "), got " + std::to_string(p.draft));
    }
    if ((p.mode == "diffusion" || p.mode == "speculative") && !m.has_clover)
        bad("mode: " + p.mode + " needs Clover's tensors: the .clover.gguf sidecar next to the model (or --sidecar)");
    if ((p.mode == "diffusion" || p.mode == "speculative") && hp.mask_id < 0) bad("mode: the model has no mask token (clover.mask_token_id)");
    return p;
}

struct Row {
    std::vector<int> prompt, tokens;
    int forwards = 0, forced_steps = 0, draft_forwards = 0;
    double first_forward_s = 0.0, first_forward_cpu_s = 0.0;  // the forward that carried the prompt (prefill)
    std::vector<int> block_steps, accept_lengths;
    std::vector<std::vector<int>> drafts;  // dflash: each verify's drafts (after the cut)
    std::string finish;
    bool finished = false;
    std::mt19937_64 rng;
    std::function<void(Row &, const std::vector<int> &)> on_commit;  // streaming: the tokens kept by one accept
    std::function<bool()> cancelled;  // --json: a cancel line for this request arrived (checked before each forward)
    bool stop_now() {
        if (!finished && cancelled && cancelled()) { finished = true; finish = "abort"; }
        return finished;
    }
};

// RowState.accept: append tokens, stopping at EOS / a stop token (not kept), a stop string (kept up to
// the token that completes it) or the length limit. Streams the kept tokens.
static void row_accept(Row & r, const Params & p, const std::vector<int> & toks) {
    if (r.finished) return;
    const int room = p.max_new - (int) r.tokens.size();
    const size_t start = r.tokens.size();
    std::string reason;
    int added = 0;
    for (int i = 0; i < std::min<int>(room, (int) toks.size()); i++) {
        const int t = toks[i];
        if ((p.eos.count(t) && !p.ignore_eos) || p.stop_ids.count(t)) {
            reason = "stop";
            break;
        }
        r.tokens.push_back(t);
        added++;
    }
    if (!p.stop.empty() && added && p.pieces) {
        // a stop string completed by a kept token: keep the shortest prefix whose text reaches its end
        // (RowState._stop_string_cut, on bytes: the same for valid UTF-8)
        std::string text;
        std::vector<size_t> ends;
        for (int t : r.tokens) {
            if (t >= 0 && t < (int) p.pieces->size()) text += (*p.pieces)[t];
            ends.push_back(text.size());
        }
        size_t end = std::string::npos;
        for (const std::string & st : p.stop) {
            const size_t f = text.find(st);
            if (f != std::string::npos) end = std::min(end, f + st.size());
        }
        if (end != std::string::npos) {
            size_t keep = r.tokens.size();
            for (size_t i = 0; i < ends.size(); i++)
                if (ends[i] >= end) { keep = i + 1; break; }
            r.tokens.resize(keep);
            reason = "stop";
        }
    }
    if (reason.empty() && (int) r.tokens.size() >= p.max_new) reason = "length";
    if (!reason.empty()) {
        r.finished = true;
        r.finish = reason;
    }
    if (r.on_commit && r.tokens.size() > start) r.on_commit(r, std::vector<int>(r.tokens.begin() + start, r.tokens.end()));
}

// ------------------------------------------------------------------- logits processing and proposal
// clover.decoding.sampling.banned_ngram_tokens: tokens completing an n-gram already in `seen` (-1 = unknown)
static std::vector<int> banned_ngram_tokens(const std::vector<int> & seen, int n) {
    std::vector<int> out;
    const int L = (int) seen.size();
    if (L < n) return out;
    for (int i = L - (n - 1); i < L; i++) if (seen[i] < 0) return out;
    for (int j = 0; j + n <= L; j++) {
        bool ok = true;
        for (int i = 0; i < n && ok; i++) ok = seen[j + i] >= 0;
        for (int i = 0; i < n - 1 && ok; i++) ok = seen[j + i] == seen[L - (n - 1) + i];
        if (ok) out.push_back(seen[j + n - 1]);
    }
    return out;
}

// clover.decoding.sampling.process_logits for one position; `seen`: the tokens it follows (prompt,
// output, then the block's positions before it, -1 where still masked), or null (no history)
static void process_logits(const Params & p, float * x, int V, const std::vector<int> * seen) {
    for (const auto & b : p.logit_bias) x[b.first] += b.second;
    if (seen && p.uses_history() && (p.repetition_penalty != 1.f || p.presence_penalty != 0.f)) {
        std::vector<char> known(V, 0);
        for (int t : *seen) if (t >= 0 && t < V) known[t] = 1;
        for (int t = 0; t < V; t++) {
            if (!known[t]) continue;
            float v = x[t];
            if (p.repetition_penalty != 1.f) v = v > 0 ? v / p.repetition_penalty : v * p.repetition_penalty;
            x[t] = v - p.presence_penalty;
        }
    }
    if (p.eos_penalty != 0.f) for (int e : p.eos) if (e >= 0 && e < V) x[e] -= p.eos_penalty;
    if (p.ignore_eos) for (int e : p.eos) if (e >= 0 && e < V) x[e] = -INFINITY;
    if (seen && p.no_repeat_ngram_size > 0)
        for (int t : banned_ngram_tokens(*seen, p.no_repeat_ngram_size)) x[t] = -INFINITY;
    for (int i = 0; i < V; i++) {  // nan_to_num(nan=-inf, posinf=FLT_MAX)
        if (std::isnan(x[i])) x[i] = -INFINITY;
        else if (x[i] == INFINITY) x[i] = FLT_MAX;
    }
}

// clover.decoding.sampling.filter_logits: temperature, top-k, top-p (sampling only)
static void filter_logits(const Params & p, std::vector<float> & x) {
    const int V = (int) x.size();
    const float mx = *std::max_element(x.begin(), x.end());
    const float t = std::max(p.temperature, 1e-30f);
    for (float & v : x) v = (v - mx) / t;
    if (p.top_k && p.top_k < V) {
        std::vector<float> s(x);
        std::nth_element(s.begin(), s.begin() + (p.top_k - 1), s.end(), std::greater<float>());
        const float kth = s[p.top_k - 1];
        for (float & v : x) if (v < kth) v = -INFINITY;
    }
    if (p.top_p < 1.f) {
        std::vector<int> order(V);
        for (int i = 0; i < V; i++) order[i] = i;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return x[a] > x[b]; });
        const float m0 = x[order[0]];
        double sum = 0.0;
        for (int i : order) sum += std::exp((double) x[i] - m0);
        double cum = 0.0;
        for (int r = 0; r < V; r++) {
            const double pi = std::exp((double) x[order[r]] - m0) / sum;
            cum += pi;
            if (r > 0 && cum - pi >= p.top_p) x[order[r]] = -INFINITY;  // keep the smallest set reaching top_p
        }
    }
}

struct Proposal {
    int tok;
    float conf, ent;
};

// clover.decoding.sampling.propose for one position: processed logits -> the token (argmax, or drawn
// from the filtered distribution), its confidence (prob / margin / entropy) and the entropy (nats)
static Proposal propose(const float * lg, int V, const Params & p, const std::vector<int> * seen, std::mt19937_64 & rng,
                        bool want_entropy) {
    std::vector<float> x(lg, lg + V);
    process_logits(p, x.data(), V, seen);
    if (!p.greedy()) filter_logits(p, x);
    float mx = -INFINITY;
    int arg = 0;
    for (int i = 0; i < V; i++)
        if (x[i] > mx) { mx = x[i]; arg = i; }
    thread_local std::vector<double> e;  // exp(x - max), computed once
    e.resize(V);
    double sum = 0.0;
    for (int i = 0; i < V; i++) sum += e[i] = exp((double) x[i] - mx);
    int tok = arg;
    if (!p.greedy()) {  // multinomial draw
        double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng) * sum, c = 0.0;
        tok = -1;
        for (int i = 0; i < V; i++) {
            const double w = e[i];
            if (w <= 0.0) continue;
            c += w;
            tok = i;
            if (u < c) break;
        }
    }
    Proposal pr{tok, (float) (e[tok] / sum), 0.f};
    if (want_entropy || p.confidence == "entropy") {  // -sum p log p = log sum - sum p (x - max): no log per token
        double ex = 0.0;
        for (int i = 0; i < V; i++)
            if (e[i] > 0.0) ex += e[i] * ((double) x[i] - mx);
        pr.ent = (float) (log(sum) - ex / sum);
    }
    if (p.confidence == "margin") {
        float second = -INFINITY;
        for (int i = 0; i < V; i++) if (i != arg && x[i] > second) second = x[i];
        pr.conf = (float) ((1.0 - exp((double) second - mx)) / sum);
    } else if (p.confidence == "entropy") {
        pr.conf = expf(-pr.ent);
    }
    return pr;
}

// clover.decoding.acceptance: indices into the candidates (block positions `pos`, ascending) to
// commit; forced when none passed
static std::vector<int> accept_rule(const Params & p, const std::vector<Proposal> & pr, const std::vector<int> & pos, bool & forced) {
    const int n = (int) pr.size();
    std::vector<int> take;
    if (p.policy == "threshold") {
        for (int i = 0; i < n; i++) if (pr[i].conf >= p.threshold) take.push_back(i);
    } else if (p.policy == "hierarchy") {
        for (int i = 0; i < n; i++) {
            const float c = pr[i].conf;
            const bool high = c >= p.threshold, mid = c >= p.low_threshold && !high;
            const float left = i > 0 && pos[i] == pos[i - 1] + 1 ? pr[i - 1].conf : -1.f;
            const float right = i + 1 < n && pos[i + 1] == pos[i] + 1 ? pr[i + 1].conf : -1.f;
            if (high || (mid && c > left && c >= right)) take.push_back(i);
        }
    } else if (p.policy == "entropy" || p.policy == "factor") {
        std::vector<int> order(n);
        for (int i = 0; i < n; i++) order[i] = i;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return pr[a].conf > pr[b].conf; });
        float cum = 0.f;
        int count = 0;
        for (int r = 0; r < n; r++) {
            bool ok;
            if (p.policy == "entropy") {
                cum += pr[order[r]].ent;
                ok = cum <= p.entropy_budget;
            } else {
                ok = pr[order[r]].conf >= 1.f - p.factor / (float) (r + 2);
            }
            if (!ok) break;
            count++;
        }
        take.assign(order.begin(), order.begin() + count);
        std::sort(take.begin(), take.end());
    } else {
        throw std::runtime_error("policy: unknown " + p.policy);
    }
    forced = take.empty();
    if (forced) {
        if (p.fallback == "leftmost") take.push_back(0);
        else {
            int best = 0;
            for (int i = 1; i < n; i++) if (pr[i].conf > pr[best].conf) best = i;
            take.push_back(best);
        }
    }
    return take;
}

// the greedy token of the processed logits (propose's, without its confidences): speculative's argmax
// (no history), and dflash's verify (`seen`: what the position follows)
// the probability softmax gives logit x[arg], the largest of x[0..V) (processed logits)
static double top_prob(const float * x, int V, int arg) {
    double sum = 0.0;
    for (int i = 0; i < V; i++) sum += exp((double) x[i] - x[arg]);
    return 1.0 / sum;
}

// the argmax of processed logits; `top`: also its probability (top_prob)
static int argmax_tok(const float * lg, int V, const Params & p, const std::vector<int> * seen = nullptr,
                      double * top = nullptr) {
    std::vector<float> x(lg, lg + V);
    process_logits(p, x.data(), V, seen);
    const int arg = (int) (std::max_element(x.begin(), x.end()) - x.begin());
    if (top) *top = top_prob(x.data(), V, arg);
    return arg;
}

// ------------------------------------------------------------------------------------ the engines
static void run_ar(Model & m, const Params & p, const std::vector<int> & prompt, Row & r) {
    const int V = m.hp.n_vocab;
    std::vector<int> pending = prompt, seen;
    Forward f;
    while (!r.stop_now()) {
        forward(m, pending, {}, {(int) pending.size() - 1}, false, f);
        if (++r.forwards == 1) { r.first_forward_s = m.last_forward_s; r.first_forward_cpu_s = m.last_forward_cpu_s; }
        const std::vector<int> * hist = nullptr;
        if (p.uses_history()) {
            seen = prompt;
            seen.insert(seen.end(), r.tokens.begin(), r.tokens.end());
            hist = &seen;
        }
        const int tok = propose(f.logits.data(), V, p, hist, r.rng, false).tok;
        row_accept(r, p, {tok});
        pending = {tok};
    }
}

static std::string text_of(const Params & p, std::vector<int>::const_iterator a, std::vector<int>::const_iterator b) {
    std::string text;
    for (; a != b; ++a)
        if (*a >= 0 && *a < (int) p.pieces->size()) text += (*p.pieces)[*a];
    return text;
}

static bool holds_stop(const Params & p, const std::string & text) {
    for (const std::string & st : p.stop)
        if (text.find(st) != std::string::npos) return true;
    return false;
}

// diffusion._token_stops: a token that ends the output by itself (a stop token, or text holding a stop string)
static bool token_stops(const Params & p, int tok) {
    if (p.stop_ids.count(tok)) return true;
    if (p.stop.empty()) return false;
    const std::vector<int> one{tok};
    return holds_stop(p, text_of(p, one.begin(), one.end()));
}

// diffusion._prefix_ends_row_impl: the block's decoded prefix ends the row (EOS, a stop token, or a stop
// string in the tail of the output so far plus the prefix)
static bool prefix_ends_row(const Params & p, const Row & r, const std::vector<int> & blk, int n) {
    for (int i = 0; i < n; i++) {
        if (!p.ignore_eos && p.eos.count(blk[i])) return true;
        if (p.stop_ids.count(blk[i])) return true;
    }
    if (!p.stop.empty()) {
        size_t longest = 0;  // in characters, as Python's len()
        for (const std::string & st : p.stop)
            longest = std::max(longest, (size_t) std::count_if(st.begin(), st.end(), [](char c) { return (c & 0xC0) != 0x80; }));
        std::vector<int> all(r.tokens);
        all.insert(all.end(), blk.begin(), blk.begin() + n);
        const size_t tail = std::min(all.size(), (size_t) n + 4 * longest + 4);
        return holds_stop(p, text_of(p, all.end() - tail, all.end()));
    }
    return false;
}

// What both block_size "auto" policies (`WidthPolicy`, `DraftPolicy`) share: the widths they choose
// among, the cost table for the result line and each decision (`policy_setup` fills the first three).
struct AutoPolicy {
    std::vector<int> widths;                // ascending
    bool verbose = false;                   // --verbose: each width decision on stderr
    json costs_json;                        // the cost table, its source and the prior, for the result line
    json choices = json::array();           // each decision that changed the width: {forward, width, expected}
    std::vector<std::string> why;           // the same as clover's width_why lines
    // Record a decision that changed the width (clover's `choices` and `width_why`): the expected
    // tokens/s per width, and the line `--verbose` prints; `what`: "width" or "draft width".
    void record_choice(const std::map<int, double> & expected, int best, int forward, const char * what) {
        if (!choices.empty() && choices.back()["width"].get<int>() == best) return;
        json e = json::object();
        std::string parts;
        char buf[64];
        for (const auto & [w, v] : expected) {
            e[std::to_string(w)] = v;
            snprintf(buf, sizeof buf, "%s%d: %.0f", parts.empty() ? "" : ", ", w, v);
            parts += buf;
        }
        choices.push_back({{"forward", forward}, {"width", best}, {"expected", e}});
        why.push_back("forward " + std::to_string(forward) + ": " + what + " " + std::to_string(best) +
                      " for 1 row(s) (expected tokens/s " + parts + ")");
        if (verbose) fprintf(stderr, "[auto] %s\n", why.back().c_str());
    }
};

// clover.decoding.diffusion.DiffusionEngine for one row
// block_size "auto" in diffusion (clover.decoding.width.WidthPolicy): at each fresh block, the width w
// among the AR step (1: a block of one, predicted by the commit part) and the trained widths with the
// most expected tokens per second, tpf(w) / cost(w), ties to the narrower:
//   tpf(w) = min(w, tokens left, 1 + s (prior(w) - 1)), prior(w) the model card's tokens per forward at
//     w (clover.block_tokens_per_forward; else w/8 within [1, 4]), s the row's gain beyond one token
//     per forward so far against the prior's (8 forwards' worth of prior);
//   cost(w) = the denoise forward of w, and once per block (tpf / w of the forwards) a block's last
//     forward (w committed + the next w denoised); w = 1 the AR step (`StepCosts`).
struct WidthPolicy : AutoPolicy {  // widths: 1 first
    static constexpr double PRIOR_PSEUDO_FORWARDS = 8.0;
    std::map<int, double> prior, denoise, block;  // denoise[1]: the AR step
    double row_scale(int tokens, int forwards, double expected_gain) const {
        const double k = PRIOR_PSEUDO_FORWARDS;
        double sum = 0.0;
        int n = 0;
        for (int w : widths) if (w > 1) { sum += prior.at(w) - 1; n++; }
        const double mean_gain = n ? sum / n : 0.0;
        const double den = k * mean_gain + expected_gain;
        return den > 0 ? std::max(0.0, (k * mean_gain + (tokens - forwards)) / den) : 1.0;
    }
    double tokens_per_forward(int w, double scale, int remaining) const {
        return std::max(1.0, std::min({(double) w, (double) std::max(remaining, 1), 1.0 + scale * (prior.at(w) - 1.0)}));
    }
    double forward_seconds(int w, double tpf) const {
        if (w == 1) return denoise.at(1);  // the AR step
        const double blocks_per_forward = std::min(1.0, tpf / w);
        return (1 - blocks_per_forward) * denoise.at(w) + blocks_per_forward * block.at(w);
    }
    int choose(double scale, int remaining, int forward) {
        std::map<int, double> expected;
        int best = widths[0];
        for (int w : widths) {
            const double tpf = tokens_per_forward(w, scale, remaining);
            expected[w] = tpf / forward_seconds(w, tpf);
            if (expected[w] > expected[best]) best = w;
        }
        record_choice(expected, best, forward, "width");
        return best;
    }
};

// clover.decoding.diffusion.DiffusionEngine for one row; with `pol` (block_size "auto") each block's
// width chosen by it when the block starts (a block of one: the AR step, no denoise block).
static void run_diffusion(Model & m, const Params & p, const std::vector<int> & prompt, Row & r, WidthPolicy * pol) {
    const int V = m.hp.n_vocab, mask = m.hp.mask_id;
    int Bs = p.block;
    double expected_gain = 0.0;  // auto: the prior's tokens beyond one per forward, summed over forwards
    std::vector<int> pending = prompt, blk;
    std::vector<char> masked;
    std::vector<float> first(V);
    int step = 0, need = 0;
    auto new_block = [&]() {
        blk.assign(Bs, mask);
        masked.assign(Bs, 1);
        step = 0;
        need = std::min(Bs, p.max_new - (int) r.tokens.size());
    };
    // DiffusionEngine._candidates: masked, before `need`, and inside the leftmost open sub-block
    auto candidates = [&]() {
        std::vector<char> open(Bs, 0);
        int first_open = -1;
        for (int j = 0; j < need; j++)
            if (masked[j]) { open[j] = 1; if (first_open < 0) first_open = j; }
        if (p.sub_block && p.sub_block < Bs && first_open >= 0) {
            const int lo = first_open - first_open % p.sub_block;
            for (int j = 0; j < Bs; j++) if (j < lo || j >= lo + p.sub_block) open[j] = 0;
        }
        return open;
    };
    new_block();
    Forward f;
    const bool want_ent = p.policy == "entropy";
    std::vector<int> seen;
    while (!r.stop_now()) {
        if (pol && step == 0) {  // a fresh block: its width
            const int w = pol->choose(pol->row_scale((int) r.tokens.size(), r.forwards, expected_gain), p.max_new - (int) r.tokens.size(), r.forwards);
            if (w != Bs) {
                Bs = w;
                new_block();
            }
        }
        const int Tc = (int) pending.size();
        std::vector<int> rows;
        if (Tc) rows.push_back(Tc - 1);
        const std::vector<char> open = candidates();
        std::vector<int> den_row(Bs, -1);  // block position j -> row of the logits that predict it
        for (int j = 1; j < Bs; j++)
            if (open[j]) { den_row[j] = (int) rows.size(); rows.push_back(Tc + j - 1); }
        forward(m, pending, Bs == 1 && Tc ? std::vector<int>() : blk, rows, false, f);  // a block of one: the AR step
        if (++r.forwards == 1) { r.first_forward_s = m.last_forward_s; r.first_forward_cpu_s = m.last_forward_cpu_s; }
        if (pol) expected_gain += pol->prior.at(Bs) - 1.0;
        if (Tc) {
            std::copy(f.logits.begin(), f.logits.begin() + V, first.begin());
            pending.clear();
        }
        step++;
        std::vector<int> cand;
        for (int j = 0; j < Bs; j++) if (open[j]) cand.push_back(j);
        std::vector<Proposal> pr;
        const size_t base_n = prompt.size() + r.tokens.size();
        if (p.uses_history()) {
            seen = prompt;
            seen.insert(seen.end(), r.tokens.begin(), r.tokens.end());
        }
        for (int j : cand) {
            const float * lg = j == 0 ? first.data() : &f.logits[(size_t) den_row[j] * V];
            const std::vector<int> * hist = nullptr;
            if (p.uses_history()) {  // what position j follows: the output, then the block before it (-1: masked)
                seen.resize(base_n);
                for (int i = 0; i < j; i++) seen.push_back(masked[i] ? -1 : blk[i]);
                hist = &seen;
            }
            pr.push_back(propose(lg, V, p, hist, r.rng, want_ent));
        }
        bool forced = false;
        std::vector<int> take = accept_rule(p, pr, cand, forced);
        if (forced) r.forced_steps++;
        std::vector<int> pos;
        for (int i : take) {
            blk[cand[i]] = pr[i].tok;
            masked[cand[i]] = 0;
            pos.push_back(cand[i]);
        }
        if (!p.ignore_eos && !p.eos.empty()) {
            int e = -1;
            for (int j : pos) if (p.eos.count(blk[j])) { e = j; break; }  // pos ascending: the first
            if (e >= 0) {
                const int eos_tok = blk[e];
                for (int j = e + 1; j < Bs; j++) {
                    blk[j] = eos_tok;
                    masked[j] = 0;
                }
            }
        }
        if (!p.stop_ids.empty() || !p.stop.empty())
            for (int j : pos) if (token_stops(p, blk[j])) { need = j + 1; break; }
        int done = need;
        for (int j = 0; j < need; j++) if (masked[j]) { done = j; break; }
        if (done < need && !(done && prefix_ends_row(p, r, blk, done))) continue;
        r.block_steps.push_back(step);
        row_accept(r, p, std::vector<int>(blk.begin(), blk.begin() + done));
        if (r.finished) break;
        pending.assign(blk.begin(), blk.begin() + done);
        new_block();
    }
}

// ------------------------------------------------------------------- the draft width (block_size "auto")
// block_size "auto" in speculative and dflash, by clover's rule (clover.decoding.width.DraftPolicy):
// before each forward that drafts, the width w with the most expected tokens per second,
// E(w, a) / cost(w), ties to the narrower. a is the row's rate of keeping a draft token so far,
// (PRIOR_N * prior + kept drafts) / (PRIOR_N + kept drafts + verifies that rejected one);
// E(w, a) = 1 + a + ... + a^(w-1), at most the tokens left; cost(w) what a step drafting w costs on
// this machine (`StepCosts`: measured at the first such request, cached, or --step-costs).
//   speculative: w among the AR step (1: no denoise block) and the model's trained widths
//     (clover.block_sizes up to 64), the prior the rate at which a draft of the model's block size keeps
//     the model card's tokens per forward there (clover.block_tokens_per_forward; else 0.5); the draft
//     is clover's adaptive one (`run_speculative`);
//   dflash: w = the anchor + drafts, among 2, 4, 8, 16 up to the drafter's block (clover's), and the AR
//     step (1: no drafter forward; the tokens' features wait for the next draft), prior 0.5, no cut.
static const int AUTO_MAX_WIDTH = 64;
// COST_WARMUP untimed rounds (the graphs built), then COST_ROUNDS timed ones; in each, per width,
// untimed steps for at least COST_SETTLE_S seconds (after a wider forward the AR step ran up to twice
// as long for its next 5 ms or so, on the Xeon VM: decoding at one width does not pay that), then
// COST_TIMED timed steps; the median of the timed steps
static const int COST_WARMUP = 1, COST_ROUNDS = 3, COST_TIMED = 2;
static const double COST_SETTLE_S = 0.02;

struct DraftPolicy : AutoPolicy {
    static constexpr double PRIOR_N = 4.0;  // the prior is worth this many verifies
    std::map<int, double> cost;             // width -> seconds of a step drafting it
    double prior_rate = 0.5;
    double acceptance(int kept, int rejected) const { return (PRIOR_N * prior_rate + kept) / (PRIOR_N + kept + rejected); }
    static double expected_tokens(int w, double rate, int remaining) {
        const double e = rate >= 1 ? (double) w : (1 - std::pow(rate, (double) w)) / (1 - rate);
        return std::max(1.0, std::min(e, (double) std::max(remaining, 1)));
    }
    static double rate_keeping(double tokens, int w) {  // the rate at which a draft of w keeps `tokens` per verify
        double lo = 0.0, hi = 1.0;
        for (int i = 0; i < 40; i++) {
            const double mid = (lo + hi) / 2;
            if (expected_tokens(w, mid, 1 << 30) < tokens) lo = mid; else hi = mid;
        }
        return (lo + hi) / 2;
    }
    // What a row keeps per forward drafting w: expected_tokens per verify; with a `horizon` (>= 0: the
    // row's forwards before took AR's step) the first forward drafting w keeps only AR's token and the
    // draft pays from the next one on, so the gain is spread over the `horizon` tokens the row is
    // expected to have left: h tokens in 1 + (h - 1) / e forwards (DraftPolicy.tokens_per_forward).
    double tokens_per_forward(int w, double rate, int remaining, double horizon) const {
        const double e = expected_tokens(w, rate, remaining);
        if (horizon < 0 || w == 1) return e;
        const double h = std::max(1.0, std::min(horizon, (double) std::max(remaining, 1)));
        return h / (1.0 + (h - 1.0) / e);
    }
    // The width for the next forward of a row that has kept `kept` draft tokens in verifies of which
    // `rejected` rejected one, with `remaining` tokens left; `forward`: the forwards so far.
    int choose(int kept, int rejected, int remaining, int forward, double horizon = -1) {
        const double a = acceptance(kept, rejected);
        std::map<int, double> expected;
        int best = widths[0];
        for (int w : widths) {
            expected[w] = tokens_per_forward(w, a, remaining, horizon) / cost.at(w);
            if (expected[w] > expected[best]) best = w;
        }
        record_choice(expected, best, forward, "draft width");
        return best;
    }
};

// What a step drafting each width costs (seconds; width 1: the AR step), per mode and expert budget.
struct StepCosts {
    std::map<int, double> seconds;  // diffusion: its denoise forward at each width (1: the AR step)
    std::map<int, double> block;    // diffusion: a block's last forward, w committed + the next w denoised
    std::string source;            // "measured", "cached" or "given" (--step-costs)
    double measure_seconds = 0.0;  // the wall time the measurement took in this process
    std::string file;              // the cache file
};

// A width-keyed table as JSON (its keys the widths as strings, as clover's)
static json width_table(const std::map<int, double> & t) {
    json j = json::object();
    for (const auto & [w, v] : t) j[std::to_string(w)] = v;
    return j;
}

// The cost table's part of a policy's costs_json (the result line's step_costs)
static json step_costs_json(const StepCosts & sc) {
    return {{"seconds", width_table(sc.seconds)}, {"source", sc.source}, {"measure_seconds", sc.measure_seconds}, {"file", sc.file}};
}

struct AutoWidth {  // the process's settings for block_size "auto"
    bool verbose = false;                   // --verbose: the cost table and each width decision on stderr
    std::map<int, double> given, given_block;  // --step-costs W:S[/B],...: the cost table, not measured
    std::string identity;                   // what a measured table depends on besides the mode (main sets it)
    std::map<std::string, StepCosts> tables;
};
static AutoWidth & auto_width() {
    static AutoWidth a;
    return a;
}

// --step-costs "1:0.001,8:0.0022,...": width -> seconds of a step drafting it (diffusion: W:D/B, its
// denoise forward and a block's last forward at that width; 1: the AR step)
static void parse_step_costs(const std::string & s, AutoWidth & aw) {
    const std::string form = "--step-costs: WIDTH:SECONDS[/SECONDS],... with widths >= 1 and seconds > 0, got '";
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        const size_t c = item.find(':'), sl = item.find('/');
        int w = 0;
        double sec = 0, blk = 1;
        try {
            size_t n1 = 0, n2 = 0, n3 = 0;
            if (c == std::string::npos) throw std::invalid_argument("no ':'");
            w = std::stoi(item.substr(0, c), &n1);
            const std::string a = item.substr(c + 1, sl == std::string::npos ? std::string::npos : sl - c - 1);
            sec = std::stod(a, &n2);
            if (sl != std::string::npos) blk = std::stod(item.substr(sl + 1), &n3);
            if (n1 != c || n2 != a.size() || (sl != std::string::npos && n3 != item.size() - sl - 1)) throw std::invalid_argument("trailing text");
        } catch (const std::exception &) {
            w = 0;
        }
        if (w < 1 || !(sec > 0) || !std::isfinite(sec) || !(blk > 0) || !std::isfinite(blk)) die(form + item + "'");
        aw.given[w] = sec;
        if (sl != std::string::npos) aw.given_block[w] = blk;
    }
    if (aw.given.empty()) die(form + s + "'");
}

// The widths a mode chooses among (`DraftPolicy`).
static std::vector<int> auto_widths(const Model & m, const std::string & mode) {
    std::set<int> w;
    if (mode == "dflash") {  // dflash.AUTO_BLOCKS
        for (int b : {2, 4, 8, 16}) if (b <= m.dr.block_size) w.insert(b);
        w.insert(m.dr.block_size);
    } else {  // width.trained_widths
        for (int b : m.hp.block_sizes) if (b <= AUTO_MAX_WIDTH) w.insert(b);
        if (w.empty()) w.insert(std::min(m.hp.block_size, AUTO_MAX_WIDTH));
    }
    w.insert(1);  // and the AR step
    return std::vector<int>(w.begin(), w.end());
}

// One step drafting each width, timed in rounds across the widths (the median of COST_ROUNDS after
// COST_WARMUP untimed rounds, so load that comes and goes spreads over every width), after a random
// 32-token prompt, the cache put back after each: speculative w > 1 a verify of w drafted tokens
// with the next w denoised (2w - 1 logit rows, their argmaxes) rolled back to half its draft, as
// most verifies end; w = 1 the AR step; dflash a drafter forward of the block [anchor, mask x (w-1)]
// over w/2 context tokens and the verify of w positions (exact or batched, as --verify) rolled back
// to half, w = 1 the AR step with the drafter's features. CPU time at 1 thread (what another process disturbs least), wall time with more.
static void measure_step_costs(Model & m, const Params & p, const std::vector<int> & widths, StepCosts & sc) {
    const bool dflash = p.mode == "dflash", diffusion = p.mode == "diffusion";
    const int V = m.hp.n_vocab, PREFIX = 32, F = dflash ? m.dr.n_features() : 0;
    std::mt19937_64 g(0);
    auto random_ids = [&](int n) {
        std::vector<int> ids(n);
        for (int & t : ids) t = 3 + (int) (g() % (uint64_t) (V - 3));
        return ids;
    };
    auto clock = [&]() { return m.n_threads == 1 ? cpu_now() : std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
    reset_cache(m, PREFIX + 2 * widths.back() + 2);
    Forward f;
    std::vector<float> ctx, feats, dl;
    forward(m, random_ids(PREFIX), {}, {PREFIX - 1}, false, f, dflash ? &ctx : nullptr);
    std::vector<std::pair<int, bool>> items;  // (width, diffusion's block forward)
    for (int w : widths) {
        items.push_back({w, false});
        if (diffusion && w > 1) items.push_back({w, true});
    }
    std::map<std::pair<int, bool>, std::vector<double>> t;
    double settle = 0.0;
    for (int round = 0; round < COST_WARMUP + COST_ROUNDS; round++)
        for (const auto & [w, blk] : items)
            for (int timed = 0, settled = 0; timed < COST_TIMED;) {
                const std::vector<int> src = random_ids(w);
                std::vector<int> rows;
                int keep = w / 2;  // committed positions kept (the rest rolled back)
                const double t0 = clock();
                if (dflash) {
                    if (w > 1) {
                        const int d0 = m.dr.n_past;
                        std::vector<int> block(w, m.dr.mask_id);
                        block[0] = src[0];
                        draft_forward(m, std::vector<float>(ctx.begin(), ctx.begin() + (size_t) (w / 2) * F), block, dl);
                        for (int j = 0; j < w - 1; j++) argmax_tok(&dl[(size_t) j * V], V, p);
                        m.dr.n_past = d0;
                    }
                    for (int j = 0; j < w; j++) rows.push_back(j);
                    forward(m, src, {}, rows, w > 1, f, &feats, m.exact_verify);
                } else if (w == 1) {
                    forward(m, src, {}, {0}, false, f);
                    rows = {0};
                } else if (diffusion) {  // a denoise forward of w (w - 1 logit rows), or a block's last: w committed too
                    if (blk) rows.push_back(w - 1);
                    for (int j = 0; j < w - 1; j++) rows.push_back((blk ? w : 0) + j);
                    forward(m, blk ? src : std::vector<int>(), std::vector<int>(w, m.hp.mask_id), rows, false, f);
                    keep = blk ? w : 0;
                } else {
                    for (int j = 0; j < 2 * w - 1; j++) rows.push_back(j);
                    forward(m, src, std::vector<int>(w, m.hp.mask_id), rows, true, f);
                }
                for (size_t j = 0; j < rows.size(); j++) argmax_tok(&f.logits[j * V], V, p);
                if (w > 1 && !diffusion) rollback(m, w, keep);
                m.row.n_past -= w > 1 ? keep : 1;  // the cache's length put back (its values do not change the cost)
                const double dt = clock() - t0;
                if (!settled) {
                    settle += dt;
                    if (settle >= COST_SETTLE_S) { settled = 1; settle = 0.0; }
                } else {
                    if (round >= COST_WARMUP) t[{w, blk}].push_back(dt);
                    timed++;
                }
            }
    for (auto & [key, v] : t) {
        std::sort(v.begin(), v.end());
        const size_t n = v.size();
        (key.second ? sc.block : sc.seconds)[key.first] = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
    }
    // no width dearer than a wider one (as speculative.step_curve): a step does not get cheaper for
    // carrying more positions, and the table is cached for good, so a burst of another process's load
    // must not stay in it as a narrow width's cost
    for (auto * c : {&sc.seconds, &sc.block}) {
        double dearest = INFINITY;
        for (auto it = c->rbegin(); it != c->rend(); ++it) it->second = dearest = std::min(dearest, it->second);
    }
}

static std::string cost_cache_dir() {
    const char * x = getenv("XDG_CACHE_HOME");
    const char * h = getenv("HOME");
    if (x && *x) return std::string(x) + "/clover/cost";
    return h && *h ? std::string(h) + "/.cache/clover/cost" : std::string();
}

static std::string file_identity(const std::string & path) {  // path, size and modification time
    struct stat st{};
    if (path.empty() || stat(path.c_str(), &st) != 0) return path;
    return path + ":" + std::to_string((long long) st.st_size) + ":" + std::to_string((long long) st.st_mtime);
}

// The cost table of a request's mode: given, from this process, from the cache file (the same
// mode, widths, model and drafter files, binary, CPU, threads, compute switches and expert sharing),
// or measured now and cached.
static StepCosts & step_costs(Model & m, const Params & p, const std::vector<int> & widths) {
    AutoWidth & aw = auto_width();
    std::string key = p.mode + " widths";
    for (int w : widths) key += " " + std::to_string(w);
    const Seq & q = row_of(m);
    key += " share " + std::to_string(q.share_budget) + (q.share_max ? " max" : " sum") + " | " + aw.identity;
    StepCosts & sc = aw.tables[key];
    if (!sc.seconds.empty()) return sc;
    const bool diffusion = p.mode == "diffusion";  // two costs per width > 1: the denoise forward, a block's last
    if (!aw.given.empty()) {
        std::string all;
        for (int x : widths) all += (all.empty() ? "" : ", ") + std::to_string(x);
        for (int w : widths) {
            const bool two = diffusion && w > 1;
            if (!aw.given.count(w) || two != (aw.given_block.count(w) > 0)) {
                sc.seconds.clear();
                sc.block.clear();
                throw std::runtime_error("--step-costs: " + std::string(aw.given.count(w) ? "" : "no cost for ") + "width " + std::to_string(w) +
                                         (two ? " needs DENOISE/BLOCK seconds" : aw.given.count(w) ? " takes one cost" : "") + " (mode " + p.mode + " chooses among " + all + ")");
            }
            sc.seconds[w] = aw.given.at(w);
            if (two) sc.block[w] = aw.given_block.at(w);
        }
        sc.source = "given";
        return sc;
    }
    uint64_t hsh = 1469598103934665603ull;  // FNV-1a of the key: the file's name
    for (unsigned char ch : key) hsh = (hsh ^ ch) * 1099511628211ull;
    char name[64];
    snprintf(name, sizeof name, "/port-%016llx.json", (unsigned long long) hsh);
    const std::string dir = cost_cache_dir();
    sc.file = dir.empty() ? "" : dir + name;
    if (!sc.file.empty()) {
        std::ifstream in(sc.file);
        try {
            if (in) {
                const json j = json::parse(in);
                if (j.at("schema") == "clover.port-cost/1" && j.at("key") == key)
                    for (int w : widths) {
                        sc.seconds[w] = j.at("seconds").at(std::to_string(w)).get<double>();
                        if (diffusion && w > 1) sc.block[w] = j.at("block").at(std::to_string(w)).get<double>();
                    }
            }
        } catch (const std::exception &) {
            sc.seconds.clear();  // unreadable or another table: measured again
            sc.block.clear();
        }
        if (!sc.seconds.empty()) sc.source = "cached";
    }
    if (sc.seconds.empty()) {
        const auto t0 = std::chrono::steady_clock::now();
        measure_step_costs(m, p, widths, sc);
        sc.measure_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        sc.source = "measured";
        if (!sc.file.empty()) {  // written whole, then renamed; a cache that cannot be written is skipped
            for (size_t i = 1; i <= dir.size(); i++)
                if (i == dir.size() || dir[i] == '/') mkdir(dir.substr(0, i).c_str(), 0755);
            const std::string tmp = sc.file + ".tmp" + std::to_string((long long) getpid());
            std::ofstream out(tmp);
            out << json({{"schema", "clover.port-cost/1"}, {"key", key}, {"seconds", width_table(sc.seconds)}, {"block", width_table(sc.block)}}).dump(1) << "\n";
            out.close();
            if (!out || rename(tmp.c_str(), sc.file.c_str()) != 0) { remove(tmp.c_str()); sc.file.clear(); }
        }
    }
    if (aw.verbose) {
        std::string parts;
        char buf[64];
        for (const auto & [w, s] : sc.seconds) {
            snprintf(buf, sizeof buf, "%s%d: %.3f ms", parts.empty() ? "" : ", ", w, 1e3 * s);
            parts += buf;
            if (sc.block.count(w)) {  // diffusion: / a block's last forward
                snprintf(buf, sizeof buf, " / %.3f ms", 1e3 * sc.block.at(w));
                parts += buf;
            }
        }
        if (sc.source == "measured") snprintf(buf, sizeof buf, " in %.2f s", sc.measure_seconds);
        fprintf(stderr, "[auto] %s step costs (%s%s%s): %s\n", p.mode.c_str(), sc.source.c_str(), sc.source == "measured" ? buf : "",
                sc.file.empty() ? "" : (", " + sc.file).c_str(), parts.c_str());
    }
    return sc;
}

// What both policies' setup shares: the mode's widths, --verbose and the cost table (measured, cached
// or given: `step_costs`) as the result line's step_costs; the table itself for the policy's own part.
static const StepCosts & policy_setup(Model & m, const Params & p, AutoPolicy & pol) {
    pol.widths = auto_widths(m, p.mode);
    pol.verbose = auto_width().verbose;
    const StepCosts & sc = step_costs(m, p, pol.widths);
    pol.costs_json = step_costs_json(sc);
    return sc;
}

// The request's policy in diffusion (block_size "auto").
static WidthPolicy width_policy(Model & m, const Params & p) {
    WidthPolicy pol;
    const StepCosts & sc = policy_setup(m, p, pol);
    pol.denoise = sc.seconds;
    pol.block = sc.block;
    for (int w : pol.widths)  // width.prior_tokens_per_forward
        pol.prior[w] = w == 1 ? 1.0 : m.hp.block_tpf.count(w) ? m.hp.block_tpf.at(w) : std::min(4.0, std::max(1.0, w / 8.0));
    pol.costs_json["block"] = width_table(sc.block);
    pol.costs_json["prior"] = width_table(pol.prior);
    return pol;
}

// The request's policy (block_size "auto" in speculative or dflash).
static DraftPolicy draft_policy(Model & m, const Params & p) {
    DraftPolicy pol;
    pol.cost = policy_setup(m, p, pol).seconds;
    if (p.mode == "speculative" && m.hp.block_tpf.count(m.hp.block_size))
        pol.prior_rate = DraftPolicy::rate_keeping(m.hp.block_tpf.at(m.hp.block_size), m.hp.block_size);
    pol.costs_json["prior_rate"] = pol.prior_rate;
    return pol;
}

// clover.decoding.speculative.SpeculativeEngine for one row (greedy; lossless w.r.t. AR). After a
// rejection the next forward commits AR's own next token (a draft of one, always kept) while it
// denoises the block after it, as clover's engine (not a denoise-only forward that commits nothing).
// The fixed draft (a block size or draft_length: every forward drafts p.draft), or with `pol`
// (block_size "auto") clover's adaptive draft: each forward's width chosen by `pol` (1: the AR step,
// no denoise block), the draft's tokens past a rejected one riding behind AR's token in the next
// draft, and a draft's first token (AR's own) emitted when drafted.
// speculative.SKIP_BLOCK_BELOW: draft auto leaves out the denoise block of a forward whose draft in flight
// is kept whole with probability below this (SpeculativeEngine.kept_whole: the product of the draft's
// tokens' denoise probabilities)
static const double SKIP_BLOCK_BELOW = 0.35;

static void run_speculative(Model & m, const Params & p, const std::vector<int> & prompt, Row & r, DraftPolicy * pol) {
    const int V = m.hp.n_vocab, mask = m.hp.mask_id;
    int D = p.draft, kept_draft = 0, rejected_draft = 0;
    std::vector<int> pending = prompt, draft, old;
    std::vector<double> sure, old_sure;  // auto: the denoise pass's top probability at each of draft[1:] (draft_sure)
    bool has_draft = false;
    std::vector<float> first(V);
    Forward f;
    while (!r.stop_now()) {
        if (pol) {  // after AR's step, a row whose draft is AR's token alone starts drafting only where that pays
            const bool starting = r.forwards > 0 && D == 1 && has_draft && draft.size() <= 1;  // (speculative.choose_draft)
            D = pol->choose(kept_draft, rejected_draft, p.max_new - (int) r.tokens.size(), r.forwards,
                            starting ? std::max<double>(1, r.tokens.size()) : -1);
        }
        int Dw = D;  // this forward's draft: none where the draft in flight is likely rejected (SpeculativeEngine._skip_block:
        // its block would draft after the whole draft; a rejection drafts on from the leftover either way)
        if (pol && Dw > 1 && has_draft && draft.size() > 1 &&
            std::accumulate(sure.begin(), sure.begin() + (draft.size() - 1), 1.0, std::multiplies<double>()) < SKIP_BLOCK_BELOW)
            Dw = 1;
        const std::vector<int> & src = has_draft ? draft : pending;
        const int Tc = (int) src.size(), Dv = has_draft ? Tc : 0;
        std::vector<int> rows;
        if (has_draft) for (int j = 0; j < Dv; j++) rows.push_back(j);
        else if (Tc) rows.push_back(Tc - 1);
        const int n_commit_rows = (int) rows.size();
        for (int j = 0; j < Dw - 1; j++) rows.push_back(Tc + j);
        // a draft of one needs no denoise block (the AR step) nor a rollback (it is always kept)
        forward(m, src, std::vector<int>(Dw > 1 ? Dw : 0, mask), rows, /*record: per-token GDN states, for a rollback*/ Dv > 1, f);
        if (++r.forwards == 1) { r.first_forward_s = m.last_forward_s; r.first_forward_cpu_s = m.last_forward_cpu_s; }
        int keep = Tc, mm = 0;
        bool next_ok = true;
        if (has_draft) {
            std::vector<int> causal(Dv);
            for (int j = 0; j < Dv; j++) causal[j] = argmax_tok(&f.logits[(size_t) j * V], V, p);
            mm = 1;
            while (mm < Dv && draft[mm] == causal[mm - 1]) mm++;
            r.accept_lengths.push_back(mm);
            keep = mm;
            std::copy(f.logits.begin() + (size_t) (mm - 1) * V, f.logits.begin() + (size_t) mm * V, first.begin());
            kept_draft += mm - 1;
            rejected_draft += mm < Dv;
            next_ok = mm == Dv;  // a draft of one (the resync after a rejection) is always kept
            row_accept(r, p, std::vector<int>(draft.begin() + (pol ? 1 : 0), draft.begin() + mm));  // adaptive: [0] emitted when drafted
        } else if (Tc) {
            std::copy(f.logits.begin(), f.logits.begin() + V, first.begin());
            pending.clear();
        }
        has_draft = false;
        if (keep != Tc) rollback(m, Tc, keep);
        if (r.finished) break;
        old.swap(draft);
        old_sure.swap(sure);
        sure.clear();
        if (next_ok && Dw > 1) {
            draft.assign(Dw, 0);
            draft[0] = argmax_tok(first.data(), V, p);
            for (int j = 0; j < Dw - 1; j++) {
                double top = 0.0;
                draft[j + 1] = argmax_tok(&f.logits[(size_t) (n_commit_rows + j) * V], V, p, nullptr, pol ? &top : nullptr);
                if (pol) sure.push_back(top);
            }
        } else {  // a rejection (this forward's block followed rejected tokens), or no block
            draft.assign(1, argmax_tok(first.data(), V, p));
            // adaptive: the draft's tokens past the rejected one ride along (denoised from masks, never
            // from the rejected token: as good a guess of the positions after AR's token), their
            // probabilities with them
            if (pol && !next_ok && mm + 1 < Dv) {
                draft.insert(draft.end(), old.begin() + mm + 1, old.end());
                sure.assign(old_sure.begin() + mm, old_sure.end());
            }
        }
        has_draft = true;
        if (pol) {  // adaptive: the draft's first token is AR's own: emitted now; a row it ends needs no further forward
            row_accept(r, p, {draft[0]});
            if (r.finished) break;
        }
    }
}

// clover.decoding.dflash: a draft cut before its first token the drafter gives less than this probability
static const float DRAFT_CUT = 0.2f;

// clover.decoding.dflash.DFlashEngine for one row (greedy; lossless w.r.t. AR). The prefill commits
// the prompt and yields the first anchor (AR's token) and the first context; then per iteration one
// drafter forward (the block [anchor, mask x D], D = the drafter's block - 1: the argmax of block
// positions 1..D, cut before the first one below DRAFT_CUT probability to the narrowest verify width
// that holds the rest; a draft_length asked for is kept whole) and one target forward committing
// [anchor, drafts] with logits at each position and the tapped features: the longest prefix of drafts
// equal to the target's tokens is kept plus the target's own next token (the next anchor); the
// target's K/V and GDN state roll back to the anchor and the kept drafts, whose features are the
// drafter's next context. With `pol` (block_size "auto") each iteration's block (the anchor + drafts)
// is chosen by `pol`, without the cut.
static void run_dflash(Model & m, const Params & p, const std::vector<int> & prompt, Row & r, DraftPolicy * pol) {
    const Drafter & d = m.dr;
    const int V = m.hp.n_vocab, F = d.n_features();
    int D = p.draft_given ? p.draft : d.block_size - 1, kept_draft = 0, rejected_draft = 0;
    const bool cut = !p.draft_given && !pol;
    const std::vector<int> widths = d.verify_widths();
    Forward f;
    std::vector<float> ctx, feats, dl, x(V);
    std::vector<int> seen, block(D + 1, d.mask_id), draft, src, rows, add;
    auto history = [&](int j) -> const std::vector<int> * {  // what verify position j follows (row_history)
        if (!p.uses_history()) return nullptr;
        seen = prompt;
        seen.insert(seen.end(), r.tokens.begin(), r.tokens.end());
        seen.insert(seen.end(), draft.begin(), draft.begin() + j);
        return &seen;
    };
    forward(m, prompt, {}, {(int) prompt.size() - 1}, false, f, &ctx);
    r.forwards = 1;
    r.first_forward_s = m.last_forward_s;
    r.first_forward_cpu_s = m.last_forward_cpu_s;
    int anchor = argmax_tok(f.logits.data(), V, p, history(0));
    row_accept(r, p, {anchor});
    while (!r.stop_now()) {
        if (pol) {
            D = pol->choose(kept_draft, rejected_draft, p.max_new - (int) r.tokens.size(), r.forwards) - 1;
            block.assign(D + 1, d.mask_id);
        }
        if (D > 0) {  // (auto's width 1 is the AR step: no draft; the context waits for the next one)
            block[0] = anchor;
            draft_forward(m, ctx, block, dl);
            r.draft_forwards++;
        }
        draft.assign(D, 0);
        int sure = D;  // drafts before the first one below DRAFT_CUT
        for (int j = 0; j < D; j++) {
            std::copy(dl.begin() + (size_t) j * V, dl.begin() + (size_t) (j + 1) * V, x.begin());
            process_logits(p, x.data(), V, nullptr);  // the drafter's logits as the target's, without history
            const int arg = (int) (std::max_element(x.begin(), x.end()) - x.begin());
            draft[j] = arg;
            if (cut && sure == D) {  // the drafter's probability of its token, up to the first below the cut
                if ((float) top_prob(x.data(), V, arg) < DRAFT_CUT) sure = j;
            }
        }
        if (cut) {  // DFlashEngine._cut
            int width = D + 1;
            for (int w : widths) if (w - 1 >= sure) { width = w; break; }
            if (width - 1 < D) draft.resize(width - 1);
        }
        r.drafts.push_back(draft);
        src.assign(1, anchor);
        src.insert(src.end(), draft.begin(), draft.end());
        rows.resize(src.size());
        for (size_t j = 0; j < src.size(); j++) rows[j] = (int) j;
        forward(m, src, {}, rows, /*record: for the rollback*/ D > 0, f, &feats, m.exact_verify);
        r.forwards++;
        add.clear();
        for (int j = 0; j <= (int) draft.size(); j++) {  // AR's token at each position, while the drafts agree
            const int tok = argmax_tok(&f.logits[(size_t) j * V], V, p, history(j));
            add.push_back(tok);
            if (j == (int) draft.size() || tok != draft[j]) break;
        }
        r.accept_lengths.push_back((int) add.size());
        kept_draft += (int) add.size() - 1;
        rejected_draft += (int) add.size() - 1 < (int) draft.size();
        row_accept(r, p, add);
        const int kept = (int) add.size();  // the anchor and the kept drafts stay in the cache
        if (kept != (int) src.size()) rollback(m, (int) src.size(), kept);
        if (r.finished) break;
        anchor = add.back();
        if (D == 0) ctx.insert(ctx.end(), feats.begin(), feats.begin() + (size_t) kept * F);  // the drafter has not seen ctx
        else ctx.assign(feats.begin(), feats.begin() + (size_t) kept * F);
    }
}

// ----------------------------------------------------------------------------------- one request
// The prompt of a request: "prompt" as token ids or text, or "messages" (the chat template).
static std::vector<int> request_prompt(const Model & m, const json & req) {
    std::vector<int> ids;
    if (req.contains("messages")) {
        ids = chat_prompt(m, req["messages"], req.value("add_generation_prompt", true));
    } else if (req.contains("prompt") && req["prompt"].is_string()) {
        ids = tokenize(m, req["prompt"].get<std::string>());
    } else if (req.contains("prompt") && req["prompt"].is_array()) {
        for (const auto & x : req["prompt"]) {
            if (!x.is_number_integer()) throw std::runtime_error("prompt: token ids must be integers");
            const int t = x.get<int>();
            if (t < 0 || t >= m.hp.n_vocab)
                throw std::runtime_error("prompt: token id " + std::to_string(t) + " is outside the vocabulary (size " + std::to_string(m.hp.n_vocab) + ")");
            ids.push_back(t);
        }
    } else {
        throw std::runtime_error("prompt: give \"prompt\" (text or token ids) or \"messages\"");
    }
    if (ids.empty()) throw std::runtime_error("prompt: empty; give at least one token");
    return ids;
}

static std::string dump(const json & j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Runs one request (its options p: make_params); `emit` gets each output line (commit events when
// streaming, then the result).
static json run_request(Model & m, const Params & p, const json & req, const std::function<void(const json &)> & emit,
                        const std::function<bool()> & cancelled = nullptr) {
    const std::vector<int> prompt = request_prompt(m, req);
    Row r;
    r.prompt = prompt;
    r.cancelled = cancelled;
    r.rng.seed(p.seeded ? p.seed : std::random_device{}());
    std::string emitted;
    if (p.stream)
        r.on_commit = [&](Row & row, const std::vector<int> & kept) {
            const std::string text = detokenize(m, row.tokens);
            std::string now = row.finished ? (row.finish == "stop" ? trim_at_stop(text, p.stop) : text)
                                           : text.substr(0, held_back(text, p.stop));
            json ev = {{"event", "commit"}, {"tokens", kept}, {"text", now.size() > emitted.size() ? now.substr(emitted.size()) : ""}};
            if (req.contains("id")) ev["id"] = req["id"];
            if (now.size() > emitted.size()) emitted = now;
            emit(ev);
        };
    Seq & q = row_of(m);  // the model's row, or this thread's batched row
    q.share_budget = p.mode == "ar" ? 0 : std::max(0, p.expert_budget);
    q.share_max = p.expert_rank == "max";
    const bool auto_draft = p.auto_width && (p.mode == "speculative" || p.mode == "dflash");  // never a batched row
    const bool auto_block = p.auto_width && p.mode == "diffusion";
    DraftPolicy pol;
    WidthPolicy wpol;
    if (tl_seq && auto_block) throw std::runtime_error("block_size: 'auto' runs alone, not as a batched row");
    if (auto_draft && p.max_new > 0) pol = draft_policy(m, p);  // may measure the step costs (on the cache, before the request's)
    if (auto_block && p.max_new > 0) wpol = width_policy(m, p);
    const int n_ctx = (int) prompt.size() + p.max_new + 2 * std::max({p.block, p.draft, p.mode == "dflash" ? m.dr.block_size : 0}) + 1;
    if (tl_seq) seq_start(m, q, n_ctx);
    else reset_cache(m, n_ctx);
    const auto t0 = std::chrono::steady_clock::now();
    timespec c0{}, c1{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
    if (p.max_new > 0) {
        if (p.mode == "ar") run_ar(m, p, prompt, r);
        else if (p.mode == "diffusion") run_diffusion(m, p, prompt, r, auto_block ? &wpol : nullptr);
        else if (p.mode == "dflash") run_dflash(m, p, prompt, r, auto_draft ? &pol : nullptr);
        else run_speculative(m, p, prompt, r, auto_draft ? &pol : nullptr);
    } else {
        r.finish = "length";
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
    const double cpu = (c1.tv_sec - c0.tv_sec) + 1e-9 * (c1.tv_nsec - c0.tv_nsec);
    const int n = (int) r.tokens.size();
    std::string text = detokenize(m, r.tokens);
    if (r.finish == "stop") text = trim_at_stop(text, p.stop);
    json out = {{"event", "done"}, {"mode", p.mode}, {"prompt_tokens", prompt.size()}, {"tokens", r.tokens}, {"n_tokens", n},
                {"text", text}, {"forwards", r.forwards}, {"tokens_per_forward", r.forwards ? (double) n / r.forwards : 0.0},
                {"seconds", secs}, {"tokens_per_second", secs > 0 ? n / secs : 0.0}, {"prefill_forward_seconds", r.first_forward_s},
                {"cpu_seconds", cpu}, {"prefill_forward_cpu_seconds", r.first_forward_cpu_s},
                {"finish", r.finish}, {"block_steps", r.block_steps}, {"forced_steps", r.forced_steps},
                {"accept_lengths", r.accept_lengths}, {"draft_forwards", r.draft_forwards}};
    if (p.mode == "dflash") {
        out["drafts"] = r.drafts;
        out["draft_cpu_seconds"] = m.dr.cpu_s;
    }
    if (tl_seq) out["batch_rows"] = q.forwards ? (double) q.rows / q.forwards : 0.0;  // rows per forward it took part in
    if ((auto_draft || auto_block) && p.max_new > 0) {  // block_size "auto": the widths chosen, why, and the cost table
        const AutoPolicy & ap = auto_block ? static_cast<const AutoPolicy &>(wpol) : pol;
        out["width_choices"] = ap.choices;
        out["width_why"] = ap.why;
        out["step_costs"] = ap.costs_json;
    }
    if (req.contains("id")) out["id"] = req["id"];
    if (!(req.contains("prompt") && req["prompt"].is_array())) out["prompt_ids"] = prompt;  // the port tokenized it
    return out;
}

// --json's stdin: request lines, read as they come; between forwards the running request looks for
// a {"cancel": id} line (poll, no wait), and a cancelled request still queued is answered at once.
struct Requests {
    std::string buf;
    std::deque<std::string> lines;
    std::set<std::string> cancelled;  // ids (as JSON text) of cancel lines seen
    bool eof = false;
    void read_some() {
        char chunk[65536];
        const ssize_t n = read(0, chunk, sizeof chunk);
        if (n <= 0) { eof = true; return; }
        buf.append(chunk, (size_t) n);
        for (size_t nl; (nl = buf.find('\n')) != std::string::npos; buf.erase(0, nl + 1)) take(buf.substr(0, nl));
    }
    // a cancel line {"cancel": id}: true, with the id as JSON text
    static bool cancel_line(const std::string & line, std::string & id) {
        if (line.find("\"cancel\"") == std::string::npos) return false;
        try {
            const json j = json::parse(line);
            if (j.is_object() && j.size() == 1 && j.contains("cancel")) { id = j["cancel"].dump(); return true; }
        } catch (const std::exception &) {}
        return false;
    }
    void take(const std::string & line) {  // a cancel line is recorded, anything else queued
        std::string id;
        if (cancel_line(line, id)) cancelled.insert(id);
        else lines.push_back(line);
    }
    bool next(std::string & line) {
        while (lines.empty() && !eof) read_some();
        if (lines.empty()) {
            if (buf.empty()) return false;
            line.swap(buf);
            buf.clear();
            return true;
        }
        line = lines.front();
        lines.pop_front();
        return true;
    }
    bool is_cancelled(const json & id) {
        pollfd pf{0, POLLIN, 0};
        while (!eof && poll(&pf, 1, 0) > 0 && (pf.revents & (POLLIN | POLLHUP))) read_some();
        return cancelled.count(id.dump()) > 0;
    }
};

// ------------------------------------------------------------------------------------------- CLI
static std::vector<int> parse_ids(const std::string & line) {
    std::vector<int> v;
    std::istringstream is(line);
    long x;
    while (is >> x) v.push_back((int) x);
    return v;
}

// A stdin line that is a request (--json: not blank; ids: some token ids; --text: any)
static bool is_request(const std::string & line, const std::string & input) {
    return input == "json" ? line.find_first_not_of(" \t\r") != std::string::npos : input == "text" || !parse_ids(line).empty();
}

// A stdin line's request: --json its JSON object (else an error naming it), --text its prompt, ids its token ids
static json request_of(const std::string & line, const std::string & input) {
    if (input == "text") return json{{"prompt", line}};
    if (input != "json") return json{{"prompt", parse_ids(line)}};
    try {
        json req = json::parse(line);
        if (!req.is_object()) throw std::runtime_error("a request is a JSON object");
        return req;
    } catch (const std::exception & e) {
        throw std::runtime_error(std::string("request: not a JSON object: ") + e.what());
    }
}

// The error event of a request that failed (with its id where it has one)
static json error_event(const std::string & message, const json & req) {
    json err = {{"event", "error"}, {"message", message}};
    if (req.is_object() && req.contains("id")) err["id"] = req["id"];
    return err;
}

static std::vector<int> parse_list(const std::string & s) {
    std::string t = s;
    for (char & ch : t) if (ch == ',') ch = ' ';
    return parse_ids(t);
}

static void usage() {
    fprintf(stderr,
        "usage: llama-clover MODEL.gguf [--sidecar F] [--mode ar|diffusion|speculative|dflash|forward] [--drafter F]\n"
        "          [options]   (dflash: --drafter F, a DFlash drafter GGUF: clover export-gguf DRAFTER_DIR F)\n"
        "  input:  (default) stdin lines of token ids | --text (stdin lines of text) | -p TEXT (one prompt,\n"
        "          its text streamed to stdout) | --chat (stdin lines: user turns, the GGUF's chat template)\n"
        "          | --json (stdin lines: JSON requests {prompt|messages, options...}; events out)\n"
        "  length: -n N, --ignore-eos, --eos IDS, --stop-ids IDS, --stop STR (repeatable)\n"
        "  block:  --block B|auto, --draft D, --sub-block S, --expert-budget M, --expert-rank sum|max\n"
        "          (auto: diffusion chooses each fresh block's width, speculative and dflash each draft's, from the\n"
        "          step costs, measured at the first such request and cached, or --step-costs W:SECONDS,...;\n"
        "          --verbose says why)\n"
        "  accept: --threshold X, --policy threshold|entropy|factor|hierarchy, --entropy-budget X,\n"
        "          --factor X, --low-threshold X, --fallback confident|leftmost, --confidence prob|margin|entropy\n"
        "  sample: --temperature T, --top-p P, --top-k K, --seed S, --repetition-penalty X,\n"
        "          --presence-penalty X, --eos-penalty X, --no-repeat-ngram N, --logit-bias JSON\n"
        "  batch:  --parallel N (--json, ids, --text: up to N requests decoded together, their rows in one\n"
        "          forward; ar, diffusion and speculative rows batch; dflash and block_size auto\n"
        "          run alone between batches)\n"
        "  other:  --stream, --threads T, --out F (forward), --moe grouped|mul_mat_id (routed experts of\n"
        "          multi-token forwards: gathered per expert, or ggml_mul_mat_id), --attn flash|plain\n"
        "          (flash: ggml_flash_attn_ext, V read as stored; plain: mul_mat, soft_max, mul_mat on a\n"
        "          transposed copy of V), --kv f32|f16 (the K/V cache's type), --verify exact|batched (dflash:\n"
        "          each verified position computed as an AR step, bit for bit; or batched: ggml's multi-column\n"
        "          kernels, faster, rounding differently), --matmul wide|ggml (q8_0 matmuls: the port's\n"
        "          AVX-512 VNNI kernel on weights repacked at load, bit for bit ggml's vec_dot, the default where\n"
        "          built with it; or ggml's kernels), --gdn fast|scalar (the GDN ops: vector\n"
        "          rows and lane sums, the default; or one running sum per output)\n");
    exit(2);
}

int main(int argc, char ** argv) {
    if (argc < 2) usage();
    std::string model_path = argv[1], sidecar, drafter, out_path, input = "ids", prompt_text, mode = "diffusion";
    json defaults = json::object();
    int threads = 1, parallel = 1;
    std::string moe = "grouped", attn = "flash", kv = "f32", verify = "exact", gdn = "fast", matmul = CLOVER_WIDE_Q8 ? "wide" : "ggml";
    std::vector<std::string> stops;
    for (int i = 2; i < argc; i++) {
        std::string a = argv[i];
        auto next = [&]() -> std::string { if (i + 1 >= argc) usage(); return argv[++i]; };
        auto value = [&](const std::string & v) {  // a number (or JSON); a bad one stops the port in one line
            try {
                return json::parse(v);
            } catch (const json::exception &) {
                die(a + (a == "--block" ? ": a number or auto" : ": a number") + " expected, got '" + v + "'");
            }
            return json();
        };
        auto num = [&]() { return value(next()); };
        if (a == "--mode") mode = next();
        else if (a == "--sidecar") sidecar = next();
        else if (a == "--drafter") drafter = next();
        else if (a == "-n" || a == "--max-new-tokens") defaults["max_new_tokens"] = num();
        else if (a == "--block") { const std::string v = next(); defaults["block_size"] = v == "auto" ? json(v) : value(v); }
        else if (a == "--step-costs") parse_step_costs(next(), auto_width());
        else if (a == "--verbose" || a == "-v") auto_width().verbose = true;
        else if (a == "--draft") defaults["draft_length"] = num();
        else if (a == "--sub-block") defaults["sub_block"] = num();
        else if (a == "--expert-budget") defaults["expert_budget"] = num();
        else if (a == "--expert-rank") defaults["expert_rank"] = next();
        else if (a == "--threshold") defaults["threshold"] = num();
        else if (a == "--policy") defaults["policy"] = next();
        else if (a == "--entropy-budget") defaults["entropy_budget"] = num();
        else if (a == "--factor") defaults["factor"] = num();
        else if (a == "--low-threshold") defaults["low_threshold"] = num();
        else if (a == "--fallback") defaults["fallback"] = next();
        else if (a == "--confidence") defaults["confidence"] = next();
        else if (a == "--temperature" || a == "--temp") defaults["temperature"] = num();
        else if (a == "--top-p") defaults["top_p"] = num();
        else if (a == "--top-k") defaults["top_k"] = num();
        else if (a == "--seed") defaults["seed"] = num();
        else if (a == "--repetition-penalty") defaults["repetition_penalty"] = num();
        else if (a == "--presence-penalty") defaults["presence_penalty"] = num();
        else if (a == "--eos-penalty") defaults["eos_penalty"] = num();
        else if (a == "--no-repeat-ngram") defaults["no_repeat_ngram_size"] = num();
        else if (a == "--logit-bias") defaults["logit_bias"] = num();  // JSON: {"id": bias, ...}
        else if (a == "--ignore-eos") defaults["ignore_eos"] = true;
        else if (a == "--eos") defaults["eos_token_ids"] = parse_list(next());
        else if (a == "--stop-ids") defaults["stop_token_ids"] = parse_list(next());
        else if (a == "--stop") stops.push_back(next());
        else if (a == "--stream") defaults["stream"] = true;
        else if (a == "--text") input = "text";
        else if (a == "--chat") input = "chat";
        else if (a == "--json") input = "json";
        else if (a == "-p" || a == "--prompt") { input = "prompt"; prompt_text = next(); }
        else if (a == "--threads" || a == "-t") threads = atoi(next().c_str());
        else if (a == "--out") out_path = next();
        else if (a == "--parallel" || a == "-np") {
            parallel = atoi(next().c_str());
            if (parallel < 1) die("--parallel: at least 1 (the rows decoded in one forward)");
        }
        else if (a == "--moe") {
            const std::string v = next();
            if (v != "grouped" && v != "mul_mat_id") die("--moe: grouped or mul_mat_id, not " + v);
            moe = v;
        } else if (a == "--attn") {
            attn = next();
            if (attn != "flash" && attn != "plain") die("--attn: flash or plain, not " + attn);
        } else if (a == "--verify") {
            verify = next();
            if (verify != "exact" && verify != "batched") die("--verify: exact or batched, not " + verify);
        } else if (a == "--matmul") {
            matmul = next();
            if (matmul != "wide" && matmul != "ggml") die("--matmul: wide or ggml, not " + matmul);
            if (matmul == "wide" && !CLOVER_WIDE_Q8) die("--matmul wide: this build has no AVX-512 VNNI (built without -march of such a CPU)");
        } else if (a == "--gdn") {
            gdn = next();
            if (gdn != "fast" && gdn != "scalar") die("--gdn: fast or scalar, not " + gdn);
        } else if (a == "--kv") {
            kv = next();
            if (kv != "f32" && kv != "f16") die("--kv: f32 or f16, not " + kv);
        }
        else usage();
    }
    if (!stops.empty()) defaults["stop"] = stops;
    if (parallel > 1 && attn != "flash") die("--parallel: batched rows need --attn flash (each row's attention over its own cache slot)");
    if (mode != "forward" && mode != "check-matmul") defaults["mode"] = mode;
    ggml_log_set([](ggml_log_level level, const char * text, void *) { if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr); }, nullptr);
    Model m;
    load_model(m, model_path, sidecar, threads);
    if (!drafter.empty()) load_drafter(m, drafter);
    m.moe_grouped = moe == "grouped";
    m.flash_attn = attn == "flash";
    m.wide = matmul == "wide";
    m.gdn_fast = gdn == "fast";
    if (m.wide) pack_model(m);
    m.kv_type = kv == "f16" ? GGML_TYPE_F16 : GGML_TYPE_F32;
    m.exact_verify = verify == "exact";
    {  // what a measured step-cost table depends on besides the mode (block_size "auto": its cache key)
        std::string cpu;
        std::ifstream ci("/proc/cpuinfo");
        for (std::string l; std::getline(ci, l);)
            if (l.rfind("model name", 0) == 0) { cpu = l.substr(l.find(':') + 1); break; }
        auto_width().identity = file_identity(model_path) + " " + file_identity(sidecar) + " " + file_identity(drafter) + " " +
                                file_identity("/proc/self/exe") + " |" + cpu + " | threads " + std::to_string(threads) + " moe " + moe +
                                " attn " + attn + " kv " + kv + " verify " + verify + " gdn " + gdn + " matmul " + matmul;
    }
    load_vocab(m, model_path);
    if (mode != "forward" && mode != "check-matmul") {
        try {
            make_params(m, defaults, json::object());  // the command line's options are checked before any input
        } catch (const std::exception & e) {
            die(e.what());
        }
    }

    std::string line;
    if (mode == "check-matmul") {
        if (!CLOVER_WIDE_Q8) die("mode check-matmul: this build has no AVX-512 VNNI (no wide kernel to check)");
        if (!m.wide) die("mode check-matmul checks the wide kernel: not with --matmul ggml");
        printf("%s\n", check_matmul().c_str());
        return 0;
    }
    if (mode == "forward") {
        if (!m.has_clover) die("mode forward needs Clover's tensors: the .clover.gguf sidecar next to the model (or --sidecar)");
        std::string l1, l2;
        std::getline(std::cin, l1);
        std::getline(std::cin, l2);
        std::vector<int> commit = parse_ids(l1), block = parse_ids(l2);
        reset_cache(m, (int) (commit.size() + block.size()) + 1);
        std::vector<int> rows;
        for (int i = 0; i < (int) (commit.size() + block.size()); i++) rows.push_back(i);
        Forward f;
        forward(m, commit, block, rows, false, f);
        if (out_path.empty()) die("forward needs --out");
        FILE * fp = fopen(out_path.c_str(), "wb");
        if (!fp) die("cannot write " + out_path);
        fwrite(f.logits.data(), sizeof(float), f.logits.size(), fp);
        fclose(fp);
        printf("{\"rows\": %zu, \"vocab\": %d}\n", rows.size(), m.hp.n_vocab);
        return 0;
    }
    auto print_line = [](const json & j) {
        printf("%s\n", dump(j).c_str());
        fflush(stdout);
    };
    if (input == "prompt" || input == "chat") {  // text to stdout as it commits; statistics to stderr
        json msgs = json::array();
        json d = defaults;
        d["stream"] = true;
        auto show = [](const json & ev) {
            if (ev["event"] == "commit") {
                fputs(ev["text"].get<std::string>().c_str(), stdout);
                fflush(stdout);
            }
        };
        auto turn = [&](const json & req) -> json {
            json out = run_request(m, make_params(m, d, req), req, show);
            fprintf(stderr, "\n[%s · llama-clover] %d tokens, %d forwards (%.2f tokens/forward), %.1f tokens/s, finish %s\n",
                    out["mode"].get<std::string>().c_str(), out["n_tokens"].get<int>(), out["forwards"].get<int>(),
                    out["tokens_per_forward"].get<double>(), out["tokens_per_second"].get<double>(), out["finish"].get<std::string>().c_str());
            return out;
        };
        try {
            if (input == "prompt") {
                turn({{"prompt", prompt_text}});
                fputs("\n", stdout);
                return 0;
            }
            fprintf(stderr, "llama-clover chat: one user turn per line (Ctrl-D ends)\n> ");
            while (std::getline(std::cin, line)) {
                if (line.empty()) { fprintf(stderr, "> "); continue; }
                msgs.push_back({{"role", "user"}, {"content", line}});
                json out = turn({{"messages", msgs}});
                msgs.push_back({{"role", "assistant"}, {"content", out["text"]}});
                fputs("\n", stdout);
                fprintf(stderr, "> ");
            }
        } catch (const std::exception & e) {
            die(e.what());
        }
        return 0;
    }
    if (parallel > 1) {  // rows in one forward: a thread per request in flight (Batcher), one reader of stdin
        m.n_slots = parallel;
        g_batch = new Batcher();
        g_batch->slot_used.assign(parallel, 0);
        struct Queue {
            std::mutex mu;
            std::condition_variable cv;
            std::deque<std::pair<long, std::string>> lines;
            std::set<std::string> cancelled;
            bool eof = false;
            long n = 0;
        } q;
        auto add = [&](const std::string & l) {  // under q.mu
            std::string id;
            if (input == "json" && Requests::cancel_line(l, id)) q.cancelled.insert(id);
            else if (is_request(l, input))
                q.lines.push_back({q.n++, l});
        };
        std::thread reader([&] {
            std::string buf;
            char chunk[65536];
            for (;;) {
                const ssize_t n = read(0, chunk, sizeof chunk);
                std::lock_guard<std::mutex> g(q.mu);
                if (n <= 0) {
                    if (!buf.empty()) add(buf);
                    q.eof = true;
                    q.cv.notify_all();
                    return;
                }
                buf.append(chunk, (size_t) n);
                for (size_t nl; (nl = buf.find('\n')) != std::string::npos; buf.erase(0, nl + 1)) add(buf.substr(0, nl));
                q.cv.notify_all();
            }
        });
        std::map<long, std::string> done;  // ids / text input: the results in input order
        long next_out = 0;
        auto worker = [&] {
            Batcher & b = *g_batch;
            for (;;) {
                std::pair<long, std::string> item;
                {
                    std::unique_lock<std::mutex> g(q.mu);
                    q.cv.wait(g, [&] { return !q.lines.empty() || q.eof; });
                    if (q.lines.empty()) return;
                    item = q.lines.front();
                    q.lines.pop_front();
                    b.joining++;
                }
                std::unique_lock<std::mutex> lk(b.mu);
                tl_lock = &lk;
                b.joining--;
                auto result = [&](const json & j) {
                    if (input == "json") { print_line(j); return; }
                    done[item.first] = dump(j);
                    for (auto it = done.find(next_out); it != done.end(); it = done.find(++next_out)) {
                        printf("%s\n", it->second.c_str());
                        fflush(stdout);
                        done.erase(it);
                    }
                };
                json req;
                Params p;
                bool batched = false;
                try {
                    req = request_of(item.second, input);
                    p = make_params(m, defaults, req);
                    // block_size auto measures its step costs with forwards of its own first: not batched
                    batched = p.mode == "ar" || ((p.mode == "diffusion" || p.mode == "speculative") && !p.auto_width);
                } catch (const std::exception & e) {
                    if (input != "json") die(e.what());
                    result(error_event(e.what(), req));
                    batch_maybe_run(m);
                    continue;
                }
                std::function<bool()> cancelled = nullptr;
                if (input == "json" && req.contains("id")) {
                    const std::string id = req["id"].dump();
                    cancelled = [&q, id]() { std::lock_guard<std::mutex> g(q.mu); return q.cancelled.count(id) > 0; };
                }
                Seq seq;
                if (batched) {
                    if (b.exclusive) {
                        batch_maybe_run(m);
                        b.cv.wait(lk, [&] { return b.exclusive == 0; });
                    }
                    seq.slot = (int) (std::find(b.slot_used.begin(), b.slot_used.end(), 0) - b.slot_used.begin());
                    b.slot_used[seq.slot] = 1;
                    b.rows++;
                    tl_seq = &seq;
                } else {
                    b.exclusive++;
                    batch_maybe_run(m);
                    b.cv.wait(lk, [&] { return b.rows == 0; });
                }
                try {
                    result(run_request(m, p, req, print_line, cancelled));
                } catch (const std::exception & e) {
                    if (input != "json") die(e.what());
                    result(error_event(e.what(), req));
                }
                if (batched) {
                    tl_seq = nullptr;
                    b.rows--;
                    b.slot_used[seq.slot] = 0;
                    batch_maybe_run(m);
                } else {
                    b.exclusive--;
                }
                b.cv.notify_all();
            }
        };
        std::vector<std::thread> workers;
        for (int i = 0; i < parallel; i++) workers.emplace_back(worker);
        for (std::thread & t : workers) t.join();
        reader.join();
        return 0;
    }
    Requests requests;
    auto next_line = [&](std::string & l) { return input == "json" ? requests.next(l) : (bool) std::getline(std::cin, l); };
    while (next_line(line)) {
        if (!is_request(line, input)) continue;
        json req;
        try {
            req = request_of(line, input);  // --json: a line that is no JSON object is an error event
            std::function<bool()> cancelled = nullptr;
            if (input == "json" && req.contains("id")) {
                const json id = req["id"];
                cancelled = [&requests, id]() { return requests.is_cancelled(id); };
            }
            print_line(run_request(m, make_params(m, defaults, req), req, print_line, cancelled));
        } catch (const std::exception & e) {
            if (input != "json") die(e.what());
            print_line(error_event(e.what(), req));
        }
    }
    return 0;
}
