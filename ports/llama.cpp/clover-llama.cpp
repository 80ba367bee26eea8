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
//     written here, so its arithmetic follows clover's formulas one to one; everything else is stock
//     ggml ops.
// and runs clover's decoding loops: ar, diffusion (clover's commit rule, forward for forward) and
// speculative (lossless w.r.t. AR greedy). docs/llama-port.md describes it.
//
// Usage: llama-clover MODEL.gguf --mode ar|diffusion|speculative|forward [options] < prompts
//   stdin: one prompt per line, as token ids separated by spaces (clover's tokenizer is exact; the
//   Python driver `clover generate --engine llama.cpp` tokenizes). Per prompt one JSON line on stdout.
//   forward: line 1 commit ids, line 2 block ids; writes f32 logits [Tc + Bd, V] to --out (every
//   commit position, then every block position) -- the test's one-forward comparison.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "gguf.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

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
    ggml_tensor *k_cache = nullptr, *v_cache = nullptr;  // [hd, n_kv_heads, n_ctx] f32
    // gated deltanet
    ggml_tensor *wqkv = nullptr, *wgate = nullptr, *conv1d = nullptr, *dt = nullptr, *ssm_a = nullptr;
    ggml_tensor *wbeta = nullptr, *walpha = nullptr, *ssm_norm = nullptr, *ssm_out = nullptr;
    ggml_tensor *conv_right = nullptr, *intra_scale = nullptr, *gain_a = nullptr, *gain_b = nullptr;  // Clover
    std::vector<float> conv_state;  // [C][K-1] the last K-1 pre-conv inputs of the prefix
    std::vector<float> S;           // [Hv][dk][dv] the prefix recurrent state
    // speculative rollback: the state before the last commit and that commit's inputs, per value head
    // [h][t][q dk | k dk | v dv | alpha | beta]; a rollback replays the kept tokens with the same code
    std::vector<float> S0, rec;
    int rec_T = 0;
    std::vector<float> window;      // [C][K-1+Tc] the last commit's conv window (speculative rollback)
    int window_len = 0;
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
};

struct GgufFile {
    gguf_context * g = nullptr;
    ggml_context * meta = nullptr;
    ggml_backend_buffer_t buf = nullptr;
};

struct Model {
    Hparams hp;
    GgufFile main_file, side_file;
    std::vector<std::string> pieces;  // each token's bytes, for stop strings
    bool has_clover = false;
    ggml_tensor *tok_embd = nullptr, *out_norm = nullptr, *output = nullptr;
    std::vector<Layer> layers;
    ggml_backend_t backend = nullptr;
    ggml_context * cache_ctx = nullptr;
    ggml_backend_buffer_t cache_buf = nullptr;
    int n_ctx = 0;
    int n_past = 0;  // committed positions
    double last_forward_s = 0.0;  // wall time of the last forward (graph build + compute)
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

// (Re)creates an empty cache for n_ctx positions.
static void reset_cache(Model & m, int n_ctx) {
    const Hparams & hp = m.hp;
    if (m.cache_ctx == nullptr || n_ctx > m.n_ctx) {
        if (m.cache_buf) ggml_backend_buffer_free(m.cache_buf);
        if (m.cache_ctx) ggml_free(m.cache_ctx);
        ggml_init_params p = {ggml_tensor_overhead() * (2 * hp.n_layer + 4), nullptr, true};
        m.cache_ctx = ggml_init(p);
        for (Layer & L : m.layers) {
            if (L.recurrent) continue;
            L.k_cache = ggml_new_tensor_3d(m.cache_ctx, GGML_TYPE_F32, hp.head_dim, hp.n_head_kv, n_ctx);
            L.v_cache = ggml_new_tensor_3d(m.cache_ctx, GGML_TYPE_F32, hp.head_dim, hp.n_head_kv, n_ctx);
        }
        m.cache_buf = ggml_backend_alloc_ctx_tensors(m.cache_ctx, m.backend);
        m.n_ctx = n_ctx;
    }
    ggml_backend_buffer_clear(m.cache_buf, 0);
    for (Layer & L : m.layers) {
        if (!L.recurrent) continue;
        L.conv_state.assign((size_t) hp.conv_dim() * (hp.conv_k - 1), 0.f);
        L.S.assign((size_t) hp.hv * hp.dk * hp.dv, 0.f);
    }
    m.n_past = 0;
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
struct GdnCall {
    Model * m;
    Layer * L;
    int Tc, Bd;
    bool record;
};

static inline float softplus_t(float x) { return x > 20.f ? x : log1pf(expf(x)); }  // torch's threshold 20
static inline float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

static void l2norm_inplace(float * x, int n) {  // x * rsqrt(sum(x^2) + 1e-6), clover's l2norm
    float s = 0.f;
    for (int i = 0; i < n; i++) s += x[i] * x[i];
    const float r = 1.f / sqrtf(s + 1e-6f);
    for (int i = 0; i < n; i++) x[i] *= r;
}

static void gdn_conv(ggml_tensor * dst, int ith, int nth, void * ud) {
    const GdnCall & c = *(const GdnCall *) ud;
    const Hparams & hp = c.m->hp;
    Layer & L = *c.L;
    const ggml_tensor * mixed = dst->src[0];
    const int C = hp.conv_dim(), K = hp.conv_k, K1 = K - 1, Tc = c.Tc, Bd = c.Bd;
    const float * w = (const float *) L.conv1d->data;  // [C][K]
    const float * wr = L.conv_right ? (const float *) L.conv_right->data : nullptr;  // [C][K-1]
    const size_t mnb = mixed->nb[1] / sizeof(float), dnb = dst->nb[1] / sizeof(float);
    const float * X = (const float *) mixed->data;
    float * Y = (float *) dst->data;
    const int W = K1 + Tc;
    std::vector<float> win(K1 + std::max(Tc, Bd) + K1);
    const int c0 = (int) ((int64_t) C * ith / nth), c1 = (int) ((int64_t) C * (ith + 1) / nth);
    for (int ch = c0; ch < c1; ch++) {
        float * st = &L.conv_state[(size_t) ch * K1];
        const float * wc = &w[(size_t) ch * K];
        if (Tc) {
            float * wn = &L.window[(size_t) ch * W];  // kept for a speculative rollback
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

// One token of the gated delta rule for value head h: x = its act row ([q|k|v] after SiLU; q, k of
// key head h % Hk), al/be the raw alpha/beta. S <- S exp(g); S <- S + k (beta (v - S^T k))^T; o = S^T q.
static void commit_step(const Hparams & hp, const Layer & L, int h, float * S, const float * qraw, const float * kraw,
                        const float * v, float al, float be, float * o, float * q, float * k, float * kv) {
    const int dk = hp.dk, dv = hp.dv;
    const float * A = (const float *) L.ssm_a->data;  // -exp(A_log)
    const float * dtb = (const float *) L.dt->data;
    std::copy(qraw, qraw + dk, q);
    std::copy(kraw, kraw + dk, k);
    l2norm_inplace(q, dk);
    l2norm_inplace(k, dk);
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

static void gdn_mix(ggml_tensor * dst, int ith, int nth, void * ud) {
    const GdnCall & c = *(const GdnCall *) ud;
    const Hparams & hp = c.m->hp;
    Layer & L = *c.L;
    const ggml_tensor * act = dst->src[0];
    const ggml_tensor * alpha = dst->src[1];
    const ggml_tensor * beta = dst->src[2];
    const int dk = hp.dk, dv = hp.dv, hk = hp.hk, hv = hp.hv, key_dim = hk * dk;
    const int Tc = c.Tc, Bd = c.Bd;
    const float * A = (const float *) L.ssm_a->data;  // -exp(A_log)
    const float * dtb = (const float *) L.dt->data;
    const size_t xnb = act->nb[1] / sizeof(float), anb = alpha->nb[1] / sizeof(float), bnb = beta->nb[1] / sizeof(float);
    const float * X = (const float *) act->data;
    const float * AL = (const float *) alpha->data;
    const float * BE = (const float *) beta->data;
    float * O = (float *) dst->data;
    const float qscale = 1.f / sqrtf((float) dk);
    const size_t hs = (size_t) dk * dv;
    std::vector<float> q(dk), k(dk), kv(dv);
    for (int h = ith; h < hv; h += nth) {
        const int kh = h % hk;
        float * S = &L.S[(size_t) h * hs];
        // ---- commit
        const size_t rw = (size_t) 2 * dk + dv + 2;  // one recorded token
        if (c.record) std::copy(S, S + hs, L.S0.begin() + (size_t) h * hs);
        for (int t = 0; t < Tc; t++) {
            const float * x = X + (size_t) t * xnb;
            const float * qr = x + kh * dk, * kr = x + key_dim + kh * dk, * v = x + 2 * key_dim + h * dv;
            const float al = AL[(size_t) t * anb + h], be = BE[(size_t) t * bnb + h];
            commit_step(hp, L, h, S, qr, kr, v, al, be, O + ((size_t) t * hv + h) * dv, q.data(), k.data(), kv.data());
            if (c.record) {
                float * r = &L.rec[((size_t) h * Tc + t) * rw];
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
        std::vector<float> qh((size_t) Bd * dk), kh_((size_t) Bd * dk), p(Bd);
        for (int t = 0; t < Bd; t++) {
            const float * x = X + (size_t) (Tc + t) * xnb;
            std::copy(x + kh * dk, x + (kh + 1) * dk, &qh[(size_t) t * dk]);
            std::copy(x + key_dim + kh * dk, x + key_dim + (kh + 1) * dk, &kh_[(size_t) t * dk]);
            l2norm_inplace(&qh[(size_t) t * dk], dk);
            l2norm_inplace(&kh_[(size_t) t * dk], dk);
        }
        for (int t = 0; t < Bd; t++) {
            const float * qt = &qh[(size_t) t * dk];
            const float g = A[h] * softplus_t(AL[(size_t) (Tc + t) * anb + h] + dtb[h]);
            const float decay = expf(g);
            float * o = O + ((size_t) (Tc + t) * hv + h) * dv;
            std::fill(o, o + dv, 0.f);
            for (int i = 0; i < dk; i++) {
                const float qi = qt[i] * qscale;
                const float * row = S + (size_t) i * dv;
                for (int j = 0; j < dv; j++) o[j] += qi * row[j];
            }
            for (int j = 0; j < dv; j++) o[j] *= decay;
            float mx = -INFINITY;
            for (int u = 0; u < Bd; u++) {
                const float * ku = &kh_[(size_t) u * dk];
                float s = 0.f;
                for (int i = 0; i < dk; i++) s += qt[i] * ku[i];
                p[u] = s * sc[h];
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

// ------------------------------------------------------------------------------------ the forward
struct Forward {
    std::vector<float> logits;  // [n_out][V], rows in the order of `out_rows`
};

// commit: tokens appended to the cache; block: one denoise block read against the cache after the
// commit (not written); out_rows: indices into [commit | block] whose logits are wanted.
static void forward(Model & m, const std::vector<int> & commit, const std::vector<int> & block,
                    const std::vector<int> & out_rows, bool record, Forward & res) {
    const Hparams & hp = m.hp;
    const int Tc = (int) commit.size(), Bd = (int) block.size(), T = Tc + Bd;
    if (T == 0) die("empty forward");
    if (m.n_past + T > m.n_ctx) die("context full");
    const int n_past = m.n_past, n_kv = n_past + T;
    const auto t_start = std::chrono::steady_clock::now();
    const size_t graph_size = 8192;
    const size_t mem = ggml_tensor_overhead() * graph_size + ggml_graph_overhead_custom(graph_size, false);
    if (m.graph_mem.size() < mem) m.graph_mem.resize(mem);
    ggml_init_params ip = {mem, m.graph_mem.data(), true};
    ggml_context * ctx = ggml_init(ip);
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, graph_size, false);

    ggml_tensor * ids = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
    ggml_set_input(ids);
    ggml_tensor * pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
    ggml_set_input(pos);
    ggml_tensor * kq_mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_kv, T);
    ggml_set_input(kq_mask);
    const int n_out = (int) out_rows.size();
    ggml_tensor * out_ids = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, std::max(1, n_out));
    ggml_set_input(out_ids);

    std::vector<GdnCall> calls(hp.n_layer);
    ggml_tensor * x = ggml_get_rows(ctx, m.tok_embd, ids);  // [H, T]
    const int H = hp.n_embd, hd = hp.head_dim, nh = hp.n_head, nkv = hp.n_head_kv;
    for (int il = 0; il < hp.n_layer; il++) {
        Layer & L = m.layers[il];
        ggml_tensor * cur = ggml_mul(ctx, ggml_rms_norm(ctx, x, hp.eps), L.attn_norm);
        if (L.recurrent) {
            ggml_tensor * mixed = ggml_mul_mat(ctx, L.wqkv, cur);    // [C, T]
            ggml_tensor * z = ggml_mul_mat(ctx, L.wgate, cur);       // [Hv*dv, T]
            ggml_tensor * al = ggml_mul_mat(ctx, L.walpha, cur);     // [Hv, T]
            ggml_tensor * be = ggml_mul_mat(ctx, L.wbeta, cur);      // [Hv, T]
            calls[il] = {&m, &L, Tc, Bd, record};
            if (Tc) L.window.resize((size_t) hp.conv_dim() * (hp.conv_k - 1 + Tc));  // before the graph runs
            L.window_len = hp.conv_k - 1 + Tc;
            if (record) {
                L.S0.resize(L.S.size());
                L.rec.resize((size_t) hp.hv * Tc * (2 * hp.dk + hp.dv + 2));
                L.rec_T = Tc;
            }
            ggml_tensor * pre = ggml_custom_4d(ctx, GGML_TYPE_F32, hp.conv_dim(), T, 1, 1, &mixed, 1, gdn_conv, GGML_N_TASKS_MAX, &calls[il]);
            ggml_tensor * args[3] = {ggml_silu(ctx, pre), al, be};
            ggml_tensor * o = ggml_custom_4d(ctx, GGML_TYPE_F32, hp.dv, hp.hv, T, 1, args, 3, gdn_mix, GGML_N_TASKS_MAX, &calls[il]);
            ggml_tensor * z3 = ggml_reshape_3d(ctx, z, hp.dv, hp.hv, T);
            o = ggml_mul(ctx, ggml_mul(ctx, ggml_rms_norm(ctx, o, hp.eps), L.ssm_norm), ggml_silu(ctx, z3));
            cur = ggml_mul_mat(ctx, L.ssm_out, ggml_reshape_2d(ctx, o, hp.dv * hp.hv, T));
        } else {
            ggml_tensor * qf = ggml_mul_mat(ctx, L.wq, cur);  // [2*hd*nh, T], per head [query | gate]
            const size_t es = ggml_element_size(qf);
            ggml_tensor * q = ggml_view_3d(ctx, qf, hd, nh, T, es * hd * 2, es * hd * 2 * nh, 0);
            ggml_tensor * gate = ggml_view_3d(ctx, qf, hd, nh, T, es * hd * 2, es * hd * 2 * nh, es * hd);
            gate = ggml_cont_2d(ctx, gate, hd * nh, T);
            q = ggml_mul(ctx, ggml_rms_norm(ctx, q, hp.eps), L.q_norm);
            ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L.wk, cur), hd, nkv, T);
            k = ggml_mul(ctx, ggml_rms_norm(ctx, k, hp.eps), L.k_norm);
            ggml_tensor * v = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L.wv, cur), hd, nkv, T);
            q = ggml_rope_ext(ctx, q, pos, nullptr, hp.n_rot, GGML_ROPE_TYPE_NEOX, 0, hp.rope_base, 1.f, 0.f, 1.f, 0.f, 0.f);
            k = ggml_rope_ext(ctx, k, pos, nullptr, hp.n_rot, GGML_ROPE_TYPE_NEOX, 0, hp.rope_base, 1.f, 0.f, 1.f, 0.f, 0.f);
            // all T new K/V go into the cache at [n_past, n_past + T): the commit part becomes prefix,
            // the block part is scratch that the next commit overwrites (never read past this forward:
            // every later query's keys end at its own forward's last position). The copies are expanded
            // first, so they run before the attention reads the cache view.
            ggml_tensor * kdst = ggml_view_3d(ctx, L.k_cache, hd, nkv, T, L.k_cache->nb[1], L.k_cache->nb[2], L.k_cache->nb[2] * n_past);
            ggml_tensor * vdst = ggml_view_3d(ctx, L.v_cache, hd, nkv, T, L.v_cache->nb[1], L.v_cache->nb[2], L.v_cache->nb[2] * n_past);
            ggml_build_forward_expand(gf, ggml_cpy(ctx, k, kdst));
            ggml_build_forward_expand(gf, ggml_cpy(ctx, v, vdst));
            ggml_tensor * K = ggml_view_3d(ctx, L.k_cache, hd, nkv, n_kv, L.k_cache->nb[1], L.k_cache->nb[2], 0);
            ggml_tensor * V = ggml_view_3d(ctx, L.v_cache, hd, nkv, n_kv, L.v_cache->nb[1], L.v_cache->nb[2], 0);
            ggml_tensor * Kp = ggml_permute(ctx, K, 0, 2, 1, 3);                  // [hd, n_kv, nkv]
            ggml_tensor * Vt = ggml_cont(ctx, ggml_permute(ctx, V, 1, 2, 0, 3));   // [n_kv, hd, nkv]
            ggml_tensor * Q = ggml_permute(ctx, q, 0, 2, 1, 3);                   // [hd, T, nh]
            ggml_tensor * kq = ggml_mul_mat(ctx, Kp, Q);                          // [n_kv, T, nh]
            kq = ggml_soft_max_ext(ctx, kq, kq_mask, 1.f / sqrtf((float) hd), 0.f);
            ggml_tensor * kqv = ggml_mul_mat(ctx, Vt, kq);                        // [hd, T, nh]
            ggml_tensor * att = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), hd * nh, T);
            att = ggml_mul(ctx, att, ggml_sigmoid(ctx, gate));
            cur = ggml_mul_mat(ctx, L.wo, att);
        }
        x = ggml_add(ctx, x, cur);
        // MoE: softmax router -> top-k -> renormalised; plus the sigmoid-gated shared expert
        ggml_tensor * h = ggml_mul(ctx, ggml_rms_norm(ctx, x, hp.eps), L.post_norm);
        const int E = hp.n_expert, k = hp.n_expert_used;
        ggml_tensor * probs = ggml_soft_max(ctx, ggml_mul_mat(ctx, L.gate_inp, h));  // [E, T]
        ggml_tensor * sel = ggml_top_k(ctx, probs, k);                               // [k, T]
        ggml_tensor * wts = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, E, T), sel);  // [1, k, T]
        wts = ggml_reshape_2d(ctx, wts, k, T);
        wts = ggml_div(ctx, wts, ggml_sum_rows(ctx, wts));
        wts = ggml_reshape_3d(ctx, wts, 1, k, T);
        ggml_tensor * h3 = ggml_reshape_3d(ctx, h, H, 1, T);
        ggml_tensor * up = ggml_mul_mat_id(ctx, L.up_exps, h3, sel);      // [I, k, T]
        ggml_tensor * gt = ggml_mul_mat_id(ctx, L.gate_exps, h3, sel);
        ggml_tensor * par = ggml_mul(ctx, ggml_silu(ctx, gt), up);
        ggml_tensor * dn = ggml_mul_mat_id(ctx, L.down_exps, par, sel);   // [H, k, T]
        dn = ggml_mul(ctx, dn, wts);
        ggml_tensor * moe = nullptr;
        for (int e = 0; e < k; e++) {
            ggml_tensor * s = ggml_view_2d(ctx, dn, H, T, dn->nb[2], e * dn->nb[1]);
            moe = moe ? ggml_add(ctx, moe, s) : s;
        }
        ggml_tensor * sh = ggml_mul_mat(ctx, L.down_shexp,
            ggml_mul(ctx, ggml_silu(ctx, ggml_mul_mat(ctx, L.gate_shexp, h)), ggml_mul_mat(ctx, L.up_shexp, h)));
        ggml_tensor * sg = ggml_sigmoid(ctx, ggml_mul_mat(ctx, L.gate_inp_shexp, h));  // [1, T]
        x = ggml_add(ctx, x, ggml_add(ctx, moe, ggml_mul(ctx, sh, sg)));
    }
    ggml_tensor * logits = nullptr;
    if (n_out) {
        ggml_tensor * xo = ggml_get_rows(ctx, x, out_ids);
        xo = ggml_mul(ctx, ggml_rms_norm(ctx, xo, hp.eps), m.out_norm);
        logits = ggml_mul_mat(ctx, m.output, xo);
        ggml_set_output(logits);
        ggml_build_forward_expand(gf, logits);
    } else {
        ggml_set_output(x);
        ggml_build_forward_expand(gf, x);
    }
    if (!ggml_gallocr_alloc_graph(m.galloc, gf)) die("graph allocation failed");

    auto set = [](ggml_tensor * t, const void * data, size_t n) {  // an input the graph does not use has no buffer
        if (t->buffer) ggml_backend_tensor_set(t, data, 0, n);
    };
    std::vector<int32_t> buf(T);
    for (int t = 0; t < Tc; t++) buf[t] = commit[t];
    for (int t = 0; t < Bd; t++) buf[Tc + t] = block[t];
    set(ids, buf.data(), sizeof(int32_t) * T);
    for (int t = 0; t < T; t++) buf[t] = n_past + t;
    set(pos, buf.data(), sizeof(int32_t) * T);
    std::vector<float> mask((size_t) n_kv * T);
    for (int t = 0; t < T; t++) {
        float * row = &mask[(size_t) t * n_kv];
        for (int j = 0; j < n_kv; j++) {
            // commit query t: the prefix and commit tokens up to itself; block query: everything
            const bool vis = t < Tc ? j <= n_past + t : true;
            row[j] = vis ? 0.f : -INFINITY;
        }
    }
    set(kq_mask, mask.data(), sizeof(float) * mask.size());
    std::vector<int32_t> oi(std::max(1, n_out), 0);
    for (int i = 0; i < n_out; i++) oi[i] = out_rows[i];
    set(out_ids, oi.data(), sizeof(int32_t) * oi.size());

    if (ggml_backend_graph_compute(m.backend, gf) != GGML_STATUS_SUCCESS) die("graph compute failed");
    res.logits.resize((size_t) n_out * hp.n_vocab);
    if (n_out) ggml_backend_tensor_get(logits, res.logits.data(), 0, sizeof(float) * res.logits.size());
    ggml_free(ctx);
    m.n_past += Tc;
    m.last_forward_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
}

// Roll the commit of the last forward back to its first `keep` tokens (speculative partial accept).
static void rollback(Model & m, int committed, int keep) {
    const Hparams & hp = m.hp;
    const int K1 = hp.conv_k - 1, C = hp.conv_dim(), dk = hp.dk, dv = hp.dv;
    m.n_past -= committed - keep;
    std::vector<float> q(dk), k(dk), kv(dv);
    for (Layer & L : m.layers) {
        if (!L.recurrent) continue;
        // S: the state before the commit, advanced by exactly the kept tokens (the forward's own code)
        L.S = L.S0;
        const size_t hs = (size_t) dk * dv, rw = (size_t) 2 * dk + dv + 2;
        for (int h = 0; h < hp.hv; h++)
            for (int t = 0; t < keep; t++) {
                const float * r = &L.rec[((size_t) h * L.rec_T + t) * rw];
                commit_step(hp, L, h, &L.S[(size_t) h * hs], r, r + dk, r + 2 * dk, r[2 * dk + dv], r[2 * dk + dv + 1],
                            nullptr, q.data(), k.data(), kv.data());
            }
        const int W = L.window_len;  // conv state: the last K-1 inputs up to the last kept token
        for (int ch = 0; ch < C; ch++)
            for (int j = 0; j < K1; j++) L.conv_state[(size_t) ch * K1 + j] = L.window[(size_t) ch * W + keep + j];
    }
}

// ------------------------------------------------------------------------------- decoding options
struct Params {
    std::string mode = "diffusion";
    int max_new = 64, block = -1, draft = -1;
    float threshold = -1.f;
    std::string policy = "threshold";
    float entropy_budget = 1.0f, factor = 1.0f;
    std::string fallback = "confident";
    bool ignore_eos = false;
    std::set<int> eos, stop_ids;
    std::vector<std::string> stop;               // stop strings (UTF-8)
    const std::vector<std::string> * pieces = nullptr;  // each token's bytes (`token_pieces`)
};

struct Row {
    std::vector<int> tokens;
    int forwards = 0, forced_steps = 0;
    double first_forward_s = 0.0;  // the forward that carried the prompt (prefill)
    std::vector<int> block_steps, accept_lengths;
    std::string finish;
    bool finished = false;
};

// RowState.accept: append tokens, stopping at EOS / a stop token (not kept), a stop string (kept up to
// the token that completes it) or the length limit.
static void row_accept(Row & r, const Params & p, const std::vector<int> & toks) {
    if (r.finished) return;
    const int room = p.max_new - (int) r.tokens.size();
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
}

struct Proposal {
    int tok;
    float conf, ent;
};

// clover.decoding.sampling.propose, greedy: processed logits -> argmax, p(argmax), entropy
static Proposal propose(const float * lg, int V, const Params & p) {
    std::vector<float> x(lg, lg + V);
    if (p.ignore_eos)
        for (int e : p.eos) if (e >= 0 && e < V) x[e] = -INFINITY;
    float mx = -INFINITY;
    int arg = 0;
    for (int i = 0; i < V; i++)
        if (x[i] > mx) { mx = x[i]; arg = i; }
    double sum = 0.0;
    for (int i = 0; i < V; i++) sum += exp((double) x[i] - mx);
    Proposal pr{arg, (float) (1.0 / sum), 0.f};
    if (p.policy == "entropy") {
        double h = 0.0;
        for (int i = 0; i < V; i++) {
            const double pi = exp((double) x[i] - mx) / sum;
            h -= pi * log(std::max(pi, 1e-30));
        }
        pr.ent = (float) h;
    }
    return pr;
}

// clover.decoding.acceptance: indices into the candidates to commit (ascending); forced if none passed
static std::vector<int> accept_rule(const Params & p, const std::vector<Proposal> & pr, bool & forced) {
    const int n = (int) pr.size();
    std::vector<int> take;
    if (p.policy == "threshold") {
        for (int i = 0; i < n; i++) if (pr[i].conf >= p.threshold) take.push_back(i);
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
        die("unknown policy " + p.policy);
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

static int argmax_tok(const float * lg, int V, const Params & p) {
    int best = -1;
    for (int i = 0; i < V; i++) {
        if (p.ignore_eos && p.eos.count(i)) continue;
        if (best < 0 || lg[i] > lg[best]) best = i;
    }
    return best;
}

// ------------------------------------------------------------------------------------ the engines
static void run_ar(Model & m, const Params & p, const std::vector<int> & prompt, Row & r) {
    const int V = m.hp.n_vocab;
    std::vector<int> pending = prompt;
    Forward f;
    while (!r.finished) {
        forward(m, pending, {}, {(int) pending.size() - 1}, false, f);
        if (++r.forwards == 1) r.first_forward_s = m.last_forward_s;
        const int tok = argmax_tok(f.logits.data(), V, p);
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

// clover.decoding.diffusion.DiffusionEngine for one row
static void run_diffusion(Model & m, const Params & p, const std::vector<int> & prompt, Row & r) {
    const int V = m.hp.n_vocab, Bs = p.block, mask = m.hp.mask_id;
    if (mask < 0) die("the model has no mask token (clover.mask_token_id)");
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
    new_block();
    Forward f;
    while (!r.finished) {
        const int Tc = (int) pending.size();
        std::vector<int> rows;
        if (Tc) rows.push_back(Tc - 1);
        std::vector<int> den_row(Bs, -1);  // block position j -> row of the logits that predict it
        for (int j = 1; j < Bs; j++)
            if (masked[j] && j < need) { den_row[j] = (int) rows.size(); rows.push_back(Tc + j - 1); }
        forward(m, pending, blk, rows, false, f);
        if (++r.forwards == 1) r.first_forward_s = m.last_forward_s;
        if (Tc) {
            std::copy(f.logits.begin(), f.logits.begin() + V, first.begin());
            pending.clear();
        }
        step++;
        std::vector<int> cand;
        for (int j = 0; j < need; j++) if (masked[j]) cand.push_back(j);
        std::vector<Proposal> pr;
        for (int j : cand) {
            const float * lg = j == 0 ? first.data() : &f.logits[(size_t) den_row[j] * V];
            pr.push_back(propose(lg, V, p));
        }
        bool forced = false;
        std::vector<int> take = accept_rule(p, pr, forced);
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

// clover.decoding.speculative.SpeculativeEngine for one row (greedy; lossless w.r.t. AR)
static void run_speculative(Model & m, const Params & p, const std::vector<int> & prompt, Row & r) {
    const int V = m.hp.n_vocab, D = p.draft, mask = m.hp.mask_id;
    if (mask < 0) die("the model has no mask token (clover.mask_token_id)");
    std::vector<int> pending = prompt, draft;
    bool has_draft = false;
    std::vector<float> first(V);
    const std::vector<int> block(D, mask);
    Forward f;
    while (!r.finished) {
        const std::vector<int> & src = has_draft ? draft : pending;
        const int Tc = (int) src.size();
        std::vector<int> rows;
        if (has_draft) for (int j = 0; j < D; j++) rows.push_back(j);
        else if (Tc) rows.push_back(Tc - 1);
        const int n_commit_rows = (int) rows.size();
        for (int j = 0; j < D - 1; j++) rows.push_back(Tc + j);
        forward(m, src, block, rows, /*record: per-token GDN states, for a rollback*/ has_draft, f);
        if (++r.forwards == 1) r.first_forward_s = m.last_forward_s;
        int keep = Tc;
        bool next_ok = true;
        if (has_draft) {
            std::vector<int> causal(D);
            for (int j = 0; j < D; j++) causal[j] = argmax_tok(&f.logits[(size_t) j * V], V, p);
            int mm = 1;
            while (mm < D && draft[mm] == causal[mm - 1]) mm++;
            r.accept_lengths.push_back(mm);
            keep = mm;
            std::copy(f.logits.begin() + (size_t) (mm - 1) * V, f.logits.begin() + (size_t) mm * V, first.begin());
            next_ok = mm == D;
            row_accept(r, p, std::vector<int>(draft.begin(), draft.begin() + mm));
        } else if (Tc) {
            std::copy(f.logits.begin(), f.logits.begin() + V, first.begin());
            pending.clear();
        }
        has_draft = false;
        if (keep != Tc) rollback(m, Tc, keep);
        if (r.finished) break;
        if (next_ok) {
            draft.assign(D, 0);
            draft[0] = argmax_tok(first.data(), V, p);
            for (int j = 0; j < D - 1; j++) draft[j + 1] = argmax_tok(&f.logits[(size_t) (n_commit_rows + j) * V], V, p);
            has_draft = true;
        }
    }
}

// ------------------------------------------------------------------------------------------- CLI
static std::vector<int> parse_ids(const std::string & line) {
    std::vector<int> v;
    std::istringstream is(line);
    long x;
    while (is >> x) v.push_back((int) x);
    return v;
}

static std::set<int> parse_set(const std::string & s) {
    std::set<int> out;
    std::string t = s;
    for (char & ch : t) if (ch == ',') ch = ' ';
    for (int x : parse_ids(t)) out.insert(x);
    return out;
}

static std::string join(const std::vector<int> & v) {
    std::string s;
    for (size_t i = 0; i < v.size(); i++) s += (i ? "," : "") + std::to_string(v[i]);
    return s;
}

static void usage() {
    fprintf(stderr,
        "usage: llama-clover MODEL.gguf [--sidecar F] --mode ar|diffusion|speculative|forward\n"
        "       [-n N] [--block B] [--draft D] [--threshold X] [--policy threshold|entropy|factor]\n"
        "       [--entropy-budget X] [--factor X] [--fallback confident|leftmost] [--ignore-eos]\n"
        "       [--eos IDS] [--stop-ids IDS] [--stop STR]... [--threads T] [--out F (forward)]\n"
        "       < prompts (token ids, one per line)\n");
    exit(2);
}

int main(int argc, char ** argv) {
    if (argc < 2) usage();
    std::string model_path = argv[1], sidecar, out_path;
    Params p;
    int threads = 1;
    bool eos_given = false;
    for (int i = 2; i < argc; i++) {
        std::string a = argv[i];
        auto next = [&]() -> std::string { if (i + 1 >= argc) usage(); return argv[++i]; };
        if (a == "--mode") p.mode = next();
        else if (a == "--sidecar") sidecar = next();
        else if (a == "-n" || a == "--max-new-tokens") p.max_new = atoi(next().c_str());
        else if (a == "--block") p.block = atoi(next().c_str());
        else if (a == "--draft") p.draft = atoi(next().c_str());
        else if (a == "--threshold") p.threshold = (float) atof(next().c_str());
        else if (a == "--policy") p.policy = next();
        else if (a == "--entropy-budget") p.entropy_budget = (float) atof(next().c_str());
        else if (a == "--factor") p.factor = (float) atof(next().c_str());
        else if (a == "--fallback") p.fallback = next();
        else if (a == "--ignore-eos") p.ignore_eos = true;
        else if (a == "--eos") { p.eos = parse_set(next()); eos_given = true; }
        else if (a == "--stop-ids") p.stop_ids = parse_set(next());
        else if (a == "--stop") p.stop.push_back(next());
        else if (a == "--threads" || a == "-t") threads = atoi(next().c_str());
        else if (a == "--out") out_path = next();
        else usage();
    }
    ggml_log_set([](ggml_log_level level, const char * text, void *) { if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr); }, nullptr);
    Model m;
    load_model(m, model_path, sidecar, threads);
    if (p.block <= 0) p.block = m.hp.block_size;
    if (p.draft <= 0) p.draft = p.block;
    if (p.threshold <= 0) p.threshold = m.hp.threshold;
    if (!eos_given && m.hp.eos_id >= 0) p.eos.insert(m.hp.eos_id);
    p.pieces = &m.pieces;
    if (!p.stop.empty() && m.pieces.empty()) die("--stop needs the GGUF's tokenizer.ggml.tokens");
    if (p.mode != "ar" && p.mode != "diffusion" && p.mode != "speculative" && p.mode != "forward") usage();
    if ((p.mode == "diffusion" || p.mode == "speculative" || p.mode == "forward") && !m.has_clover)
        die("mode " + p.mode + " needs Clover's tensors: the .clover.gguf sidecar next to the model (or --sidecar)");

    std::string line;
    if (p.mode == "forward") {
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
    while (std::getline(std::cin, line)) {
        std::vector<int> prompt = parse_ids(line);
        if (prompt.empty()) continue;
        reset_cache(m, (int) prompt.size() + p.max_new + 2 * std::max(p.block, p.draft) + 1);
        Row r;
        const auto t0 = std::chrono::steady_clock::now();
        if (p.max_new > 0) {
            if (p.mode == "ar") run_ar(m, p, prompt, r);
            else if (p.mode == "diffusion") run_diffusion(m, p, prompt, r);
            else run_speculative(m, p, prompt, r);
        } else {
            r.finish = "length";
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const int n = (int) r.tokens.size();
        printf("{\"mode\": \"%s\", \"prompt_tokens\": %zu, \"tokens\": [%s], \"n_tokens\": %d, \"forwards\": %d, "
               "\"tokens_per_forward\": %.4f, \"seconds\": %.6f, \"tokens_per_second\": %.3f, \"prefill_forward_seconds\": %.6f, \"finish\": \"%s\", "
               "\"block_steps\": [%s], \"forced_steps\": %d, \"accept_lengths\": [%s]}\n",
               p.mode.c_str(), prompt.size(), join(r.tokens).c_str(), n, r.forwards,
               r.forwards ? (double) n / r.forwards : 0.0, secs, secs > 0 ? n / secs : 0.0, r.first_forward_s, r.finish.c_str(),
               join(r.block_steps).c_str(), r.forced_steps, join(r.accept_lengths).c_str());
        fflush(stdout);
    }
    return 0;
}
