// Host-side entry points of the CUDA kernels. Plain C++ (no CUDA syntax): src/cuda and the tests
// include it. Every function enqueues work on `stream` and returns the launch status; device
// pointers throughout. The kernels are named for what they compute; each has a CPU twin in tests/cuda.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>

namespace moe::cuda::k {

// A weight matrix on the device in the layout of layout.cuh: `rows` rows of `cols` elements,
// consecutive rows `row_stride` bytes apart; 3-D expert tensors hold experts `expert_stride` apart.
struct Mat {
  const uint8_t* data = nullptr;
  uint32_t type = 0;
  int32_t rows = 0;
  int32_t cols = 0;
  int64_t row_stride = 0;
  int64_t expert_stride = 0;
};

// RoPE parameters (REFERENCE.md §4.5), resolved on the host.
struct Rope {
  float theta_scale = 1.f;  // base^(-2/n_rot)
  float freq_scale = 1.f;   // 1/factor (linear and YaRN)
  float mscale = 1.f;       // magnitude of cos/sin
  float corr_lo = 0.f, corr_hi = 0.f;  // YaRN ramp bounds
  int yarn = 0;
};

int sm_count();  // of the current device (cached)

// A switch from the environment (experiments, A/B runs): default_on reads "on unless NAME=0", otherwise
// "off unless NAME=1".
inline bool env_switch(const char* name, bool default_on) {
  const char* v = std::getenv(name);
  return default_on ? !(v && v[0] == '0') : (v && v[0] == '1');
}
// A number from the environment, clamped to [lo, hi]; `otherwise` when NAME is unset.
inline int env_int(const char* name, int otherwise, int lo, int hi) {
  const char* v = std::getenv(name);
  if (!v) return otherwise;
  const int n = std::atoi(v);
  return n < lo ? lo : n > hi ? hi : n;
}

// The decode's reads marked evict_first in L2 (common.cuh: l2_evict_first), bits of MOE_CUDA_EVICT=N (default
// all; 0 none): the expert gate/up rows, the expert down rows, the LM head's rows, the attention's K/V cache
// rows. Each is read once per token (docs/PERFORMANCE.md version 24: +0.4 % decode from context 0, +0.7 % at
// depth 4096).
constexpr int kEvictGateUp = 1, kEvictDown = 2, kEvictLmHead = 4, kEvictKv = 8, kEvictAll = 15;
inline int l2_evict_mask() { return env_int("MOE_CUDA_EVICT", kEvictAll, 0, kEvictAll); }

// Sets the shared-memory limits of the kernels that may need more than 48 KiB.
cudaError_t init_kernels();

// out[t][:] = dequantized row ids[t] of W, for t < n (the embedding lookup).
cudaError_t embed_rows(const Mat& W, const int32_t* ids, int n, float* out, cudaStream_t s);

// out[t][:] = rmsnorm(x[t]) * w for t < n; rows `stride` floats apart.
cudaError_t rmsnorm_rows(const float* x, const float* w, int n, int cols, int stride, float eps, float* out,
                         cudaStream_t s);

// Decode GEMV over up to three matrices sharing the input: y_i[r] (+)= W_i.row(r) · h, where h = x,
// or rmsnorm(x) * norm_w when norm_w is set. Every matrix has x's length as cols.
struct GemvOut {
  Mat W;
  float* y = nullptr;
};
// What the next kernel will read that is not in L2 yet: rows [0, min(pos[0], max_rows)) of row_bytes each
// at base[0] and base[1] (the decode attention's K and V cache rows). One block of the GEMV sends them
// to L2 while the GEMV runs, so that their address translation and DRAM reads are off the next
// kernel's critical path. A hint: nothing else depends on it.
struct L2Hint {
  const void* base[2] = {nullptr, nullptr};
  const int32_t* pos = nullptr;
  int row_bytes = 0;
  int max_rows = 0;
};
// The decode's MoE routing without a kernel of its own (when router_in_o_proj_supported): the O
// projection's blocks add their rows' share of the router's dot products with norm_w ⊙ x (the new x)
// to acc[0..n), and the gate/up kernel (expert_gate_up_acc) ranks them and scales them by rmsnorm's
// 1/rms, which its own staging of rmsnorm(x) * norm_w uses. acc[n] collects Σ x² (rmsnorm's sum of
// squares) the same way.
// acc holds int64 fixed point in units of 2^-32 ref[0] (2^-32 ref[0]² for acc[n]): integer sums do not
// depend on the order in which the blocks add, so the routing is deterministic. ref[0] is any positive
// value of the order of x's RMS (the Q/K/V GEMV writes its input's, the same layer's x before the
// attention, and zeroes acc: `prep` below); a logit is then exact to ~1e-9 of its unit whatever the
// scale of x.
struct RouterAcc {
  long long* acc = nullptr;  // n + 1 int64
  float* ref = nullptr;      // one float
  int n = 0;                 // experts
};
// The decode attention's slices left to the O projection (attention_decode's `defer`, o_proj_router's
// `att`): when the position's context is cut into 2 .. defer slices (at most kAttMaxDefer), the attention
// writes each slice's output with its softmax max and sum to `partials` and stops there; the O
// projection's blocks merge them while they stage their input, in the attention's own order of
// operations (the same floats as its merge). One slice, or more than defer, and the attention merges
// as before (its last block, after a counter). Slices: dev::dec_slices (common.cuh); partials hold
// attention_partial_stride(head_dim) floats per (KV head, slice, query head of the group): the slice's
// normalised output (Σ p v / Σ p, a weighted mean of fp16 cache rows, so in fp16's range) as head_dim
// fp16 values, then its max m and sum L as floats (16-byte rows). Half the bytes of fp32 partials for the
// O projection's 128 blocks that each read every slice; the rounding (at most 2^-11 of the value) is that
// of the cache rows themselves.
// 4: with the attention's own merge cheap (8-byte loads, one acquire-release add), the O projection's
// merge of 5-8 slices cost more than it saved (CLI, 48 tokens after 200: 585.5-586.0 tok/s deferring up
// to 4, 578.9-579.0 up to 8; after 136: 597.5-597.8 vs 593.3-593.4; run r19).
constexpr int kAttMaxDefer = 4;
struct AttSlices {
  const float* partials = nullptr;  // null: the O projection reads the merged output
  const int32_t* pos = nullptr;     // the decode position (the context is pos[0] + 1 long)
  int n_head_kv = 0, group = 0, head_dim = 0, n_split = 1, min_chunk = 32, defer = 0;
};
constexpr int attention_partial_stride(int head_dim) { return head_dim / 2 + 4; }  // 16-byte rows (head_dim % 8 == 0)
// Contexts of many slices merge in two levels (attention_decode's `tree`): the last block of each run of
// attention_leaf() slices merges them into a group partial (the same record: the group's normalised output in
// fp16, its max and sum), and the last of those merges the groups, so that the merge after the slowest
// slice reads at most a run of slices and n_split / run groups instead of every slice (at 4,096 positions
// a single merge of 43 slices took ~6 us, three load batches each behind an L2 round trip).
constexpr int kAttLeafMin = 4, kAttLeafMax = 16;
constexpr int kAttMaxSplit = 128;  // attention_decode's n_split at most
// groups (and their counters) the scratch holds room for: as many as the shortest run makes
constexpr int attention_leaf_groups(int n_split) { return (n_split + kAttLeafMin - 1) / kAttLeafMin; }
// attention_decode's scratch: partials (floats: every slice's record, then every group's) and counters
// (ints: one per KV head, then one per KV head and group; zero before the first call, and every launch
// leaves them zero).
constexpr size_t attention_partials_floats(int n_head_kv, int n_split, int group, int head_dim) {
  return static_cast<size_t>(n_head_kv) * (n_split + attention_leaf_groups(n_split)) * group *
         attention_partial_stride(head_dim);
}
constexpr int attention_counter_ints(int n_head_kv, int n_split) {
  return n_head_kv * (1 + attention_leaf_groups(n_split));
}
// The fewest slices merged in two levels (17 unless MOE_CUDA_ATT_TREE=n; 0: never; more than 64 always),
// and the slices of a run (8 unless MOE_CUDA_ATT_LEAF=n, kAttLeafMin..kAttLeafMax).
int attention_tree_min();
int attention_leaf();
// The decode attention's minimum slice length (32 positions; MOE_CUDA_ATT_CHUNK=n for experiments).
int attention_min_chunk();

// Weights that the kernel after next will read (the next layer's Q, K and V): every block of the kernel
// given them sends its 1/gridDim share of each region to L2 at its start, so that they are there when
// that kernel's blocks, which cannot start while the giver's blocks fill the SMs, need them.
struct L2Ahead {
  const void* base[3] = {nullptr, nullptr, nullptr};
  int64_t bytes[3] = {0, 0, 0};  // multiples of 16 (weight rows are, layout.cuh)
};
// gemv with prep set (tensor-core types and norm_w only): block 0 also writes ref = sqrt(mean(x²) + eps)
// and zeroes acc[0..n].
cudaError_t gemv(const GemvOut* outs, int n_outs, const float* x, const float* norm_w, float eps, bool accumulate,
                 cudaStream_t s, const L2Hint* hint = nullptr, const RouterAcc* prep = nullptr,
                 bool weights_in_l2 = false);
// weights_in_l2: an earlier kernel sent the matrices to L2 (expert_gate_up_acc's or expert_down_add's
// `ahead`): the tensor-core GEMV does not prefetch them itself (its one-tile kernel copies its tile into
// shared memory before its wait either way, gemv_tc.cu).
// x += O·o, acc[c] += Σ_r R[c][r] norm_w[r] x[r] and acc[n] += Σ_r x[r]² over the new x (units as above).
// att (when given and att->defer > 0): o is the attention's output unless it left slices to merge (above).
// Each block reads its rows of x before its wait (MOE_CUDA_X_EARLY=0: after its MMAs, as a plain GEMV
// does): x must not be written by the kernel launched just before this one (in the decode that kernel is
// the attention; x was last written three kernels back).
cudaError_t o_proj_router(const Mat& O, const float* o, float* x, const Mat& R, const float* norm_w,
                          const RouterAcc& acc, cudaStream_t s, const AttSlices* att = nullptr);
// The chosen experts' ids as an early hint for the down kernel: the gate/up kernel's block 0 writes the
// ids, then *tag = early_ids_tag(pos[0], layer) (release); each down block reads the tag before its wait
// for the gate/up grid and, when it matches, fetches its rows of those experts right away (into shared
// memory, or to L2; the gate/up grid's last blocks are still running, its ids were written long before).
// A hint only: the down kernel multiplies with the ids it reads after its wait, so a stale or missing tag
// costs at most a copy. Layers < 1024.
struct EarlyIds {
  int* tag = nullptr;  // null: no hint
  const int32_t* pos = nullptr;
  int layer = 0;
  const int32_t* hint = nullptr;  // the hint's ids (null: the ids themselves; tests point it elsewhere)
};
constexpr int early_ids_tag(int pos, int layer) { return (pos + 1) * 1024 + layer; }
// expert_gate_up with the logits from o_proj_router's acc: h = rmsnorm(x) * norm_w staged in every
// block with 1/rms = (acc[n] 2^-32 ref² / n_x + eps)^-1/2, logits = acc[c] 2^-32 ref / rms; the choice and
// weights as expert_gate_up's. ahead: its blocks send their share to L2 at their start (L2Ahead).
cudaError_t expert_gate_up_acc(const Mat& G, const Mat& U, const float* x, const float* norm_w, float eps,
                               const RouterAcc& acc, int n_used, int32_t* ids, float* weights, float* act,
                               cudaStream_t s, const EarlyIds* early = nullptr,
                               const L2Ahead* ahead = nullptr);

// MoE routing for one token, first half: h = rmsnorm(x) * norm_w (written to h_out) and the router
// logits = R·h (R.rows floats). The experts are chosen by expert_gate_up.
cudaError_t route_token(const float* x, const float* norm_w, float eps, const Mat& R, float* h_out, float* logits,
                        cudaStream_t s);

// Second half and the experts' first matrices (decode): softmax over the n_expert logits, the n_used
// largest (lowest id on ties), weights renormalised over the chosen set -> ids/weights (rank order);
// act[j][r] = silu(G_e.row(r)·h) * (U_e.row(r)·h) for e = ids[j], j < n_used (n_expert <= 1024,
// n_used <= 64).
cudaError_t expert_gate_up(const Mat& G, const Mat& U, const float* h, const float* logits, int n_expert, int n_used,
                           int32_t* ids, float* weights, float* act, cudaStream_t s);
// x[r] += Σ_j weights[j] * D_e.row(r)·act[j] for e = ids[j] (decode). The tensor-core kernel reads its rows
// of x before its wait, like o_proj_router (the kernel just before, the gate/up one, must not write x).
cudaError_t expert_down_add(const Mat& D, const float* act, const int32_t* ids, const float* weights, int n_used,
                            float* x, cudaStream_t s, const L2Ahead* ahead = nullptr, const EarlyIds* early = nullptr);
// Whether expert_down_add sends `ahead` to L2 for this matrix (the tensor-core kernel does).
bool expert_down_sends_ahead(const Mat& D);

// Per-head RMSNorm of q and k (gains q_norm/k_norm over head_dim), NEOX RoPE at position
// pos0[0] + t, then K and V (as fp16) into the cache rows of those positions. qkv holds n rows of
// [q | k | v] (q_dim + 2 kv_dim floats); q is normalised in place. rope_cs: rope_table of the n
// positions, or null (each block then evaluates its angles).
cudaError_t qk_norm_rope_store(float* qkv, int n, const int32_t* pos0, const float* q_norm, const float* k_norm,
                               int n_head, int n_head_kv, int head_dim, float eps, Rope rope, void* k_cache,
                               void* v_cache, const float* rope_cs, cudaStream_t s);

// Causal GQA attention of n query rows (in qkv, row stride qkv_stride floats; q already normalised
// and rotated) at positions pos0[0] + t over the fp16 cache, whose rows up to pos0[0] + n - 1 are
// written; out[t] = concat of heads (n_head * head_dim floats). Tensor cores (f16 MMAs on split
// fp16 pairs, fp32 accumulation and softmax).
cudaError_t attention(const float* qkv, int qkv_stride, int n, const int32_t* pos0, const void* k_cache,
                      const void* v_cache, int n_head, int n_head_kv, int head_dim, float* out, cudaStream_t s);
bool attention_supported(int n_head, int n_head_kv, int head_dim);
// Decode (one token at pos0[0]): qk_norm_rope_store and attention in one launch. qkv holds the raw
// [q | k | v] row (left unchanged); the KV cache row of the position is written; out as attention.
// rope_cs: the position's table from rope_table, or null (each block then evaluates the angles).
// partials and counters: attention_partials_floats and attention_counter_ints (above).
cudaError_t attention_decode(const float* qkv, const int32_t* pos0, const float* q_norm, const float* k_norm, float eps,
                             Rope rope, void* k_cache, void* v_cache, int n_head, int n_head_kv, int head_dim,
                             int n_split, float* partials, int* counters, float* out, const float* rope_cs,
                             cudaStream_t s, int defer = 0);
// RoPE tables of positions pos0[0] + t, t < n: row t (head_dim floats at out + t head_dim) holds the cos
// of the pairs in [0, head_dim/2) and their sin in [head_dim/2, head_dim).
cudaError_t rope_table(const int32_t* pos0, int n, Rope rope, int head_dim, float* out, cudaStream_t s);
// A decode token's embed_rows (one row of embd for token[0] into x) and rope_table (position pos[0] into
// rope_out) in one launch: the same results as the two.
cudaError_t token_start(const Mat& embd, const int32_t* token, float* x, const int32_t* pos, Rope rope, int head_dim,
                        float* rope_out, cudaStream_t s);

// out[0] = argmax of x[0..n) (lowest index on ties, non-finite values skipped), out[1] = 1 when some
// x is not finite (else 0), in one launch; scratch holds kArgmaxScratch floats, zero before the first
// launch (its counter is left at zero). A decode chained on the device: the index also goes to
// next_token[0] and next_pos[0] grows by one (each when given), so that the next decode graph can run
// without the host. host: two {argmax, non-finite} slots in mapped pinned memory (a device pointer); the
// result goes to slot next_pos[0] & 1 (the step's position, before the increment) instead of out, so that
// no copy has to follow the graph.
constexpr int kArgmaxScratch = 260;  // 128 partial maxima, their indices, the counter
cudaError_t argmax(const float* x, int n, float* scratch, int32_t* out, cudaStream_t s, int32_t* next_token = nullptr,
                   int32_t* next_pos = nullptr, int32_t* host = nullptr);

// The decode step's token drawn from logits x[0..n) on the device, as moe::run::Sampler::sample draws it
// (repeat penalty -> greedy, or temperature -> top-k -> top-p -> min-p -> draw; src/run/sampler.cpp) for
// top-k 1..kSampleMaxK and windows of at most kSampleMaxWindow tokens: the same token for the same logits and
// uniform (double sums in the host's order; exp and log in CUDA's double precision, within an ulp of the
// host's, and tempered values below 2^-126 may be flushed to zero: a different token only where a sum or a
// floor lands within rounding of a cut). The step's position is next_pos[0] = p; the penalty's window is
// hist[p + 1 - m .. p] (m = min(p + 1, last_n)); the draw's uniform is u[p & 1] (two slots, mapped pinned
// memory written by the host before the launch; unread when greedy). The token goes to {out[0], out[1]} or
// with `host` to the slot of p's parity there ({token, 1 when some logit is not finite}), and to
// next_token[0] and hist[p + 1] (when p + 1 < n_ctx); next_pos[0] becomes p + 1. scratch: kSampleScratchBytes,
// zero before the first launch (its counters are left at zero).
struct SampleParams {
  float temperature = 1.f;
  int top_k = 40;
  float top_p = 1.f;  // 1 = off
  float min_p = 0.f;  // 0 = off
  float penalty = 1.f;  // 1 = off
  int last_n = 0;
  int greedy = 0;  // argmax of the penalised logits (temperature, top-k/p, min-p and the uniform unused)
};
constexpr int kSampleMaxK = 128;
constexpr int kSampleMaxWindow = 1024;
constexpr int kSampleMaxChunk = 8192;
constexpr size_t kSampleScratchBytes = 16 + 8192 * 8;  // two counters, the blocks' first keys
// The vocabulary slice of one block (0: these parameters and vocabulary size have no device sampler).
int sample_chunk(const SampleParams& p, int n_vocab);
bool sample_supported(const SampleParams& p, int n_vocab);
cudaError_t sample(const float* x, int n, const SampleParams& p, void* scratch, int32_t* hist, int n_ctx,
                   const double* u, int32_t* out, int32_t* host, int32_t* next_token, int32_t* next_pos,
                   cudaStream_t s);

#ifdef MOE_TRACE
// Attach the per-block trace buffer (dev::TraceRec[kTraceCap], trace.cuh) and its counter to the traced
// translation units.
cudaError_t trace_attach_gemv_tc(void* buf, void* count);
cudaError_t trace_attach_gemv(void* buf, void* count);
cudaError_t trace_attach_attention(void* buf, void* count);
cudaError_t trace_attach_decode_persist(void* buf, void* count);
#endif

// An empty kernel of `blocks` x `threads` (measures the launch floor in a graph).
cudaError_t noop(int blocks, int threads, cudaStream_t s);
// Benchmark support (address translation): links[i] = offsets[(i + 1) % n] for the n byte offsets (8-byte
// aligned) into base, then one thread follows `steps` links from offsets[0] through L2 and writes the
// elapsed SM cycles to cycles[0] (and the last address to cycles[1]). With one offset per 2 MiB page
// the lines all fit in L2 after a first pass, so the time per step is L2 latency plus any page walk.
cudaError_t chain_links(void* base, const int64_t* offsets, int n, cudaStream_t s);
cudaError_t chase_links(const void* base, int64_t first, int steps, long long* cycles, cudaStream_t s);

// ---- the persistent decode kernel (decode_persist.cu) ---------------------------------------------------
// Every layer of one decode token in one cooperative launch (grid barriers between the phases; weight
// rows sent to L2 ahead of their phase). The layer table lives in device memory.
// One layer's weights on the device (also the host forward's layer table, src/cuda/forward.hpp).
struct LayerWeights {
  Mat q, k, v, o, router, gate, up, down;
  const float *attn_norm = nullptr, *ffn_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr;
};
// Whether a layer's decode can route through o_proj_router / expert_gate_up_acc: tensor-core Q, K, V, O,
// gate and up matrices (the Q/K/V GEMV prepares the sums), an F32 router of at most 256 experts by x's
// length, n_used <= 64, MOE_CUDA_TC not 0.
bool router_in_o_proj_supported(const LayerWeights& L, int n_used);
// A layer table entry: the weights and the layer's KV cache (trivially copyable: the kernel copies
// entries to shared memory word by word).
struct PersistLayer : LayerWeights {
  void *k_cache = nullptr, *v_cache = nullptr;
};
struct PersistArgs {
  const PersistLayer* layers = nullptr;  // device array of n_layers
  int n_layers = 0;
  float *x = nullptr, *qkv = nullptr, *o = nullptr, *logits = nullptr, *act = nullptr, *partials = nullptr;
  int* counters = nullptr;    // attention_decode's (n_head_kv ints, zero, left zero)
  unsigned* barrier = nullptr;  // one counter, zeroed by decode_persist before the launch
  const int32_t* pos = nullptr;
  const float* rope_cs = nullptr;  // rope_table of the position (computed before the launch)
  uint64_t* profile = nullptr;  // optional: [barrier][block] {arrive ns, leave ns, arrive clock64} (%globaltimer)
  Rope rope;
  float eps = 0.f;
  int n_embd = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_expert = 0, n_used = 0, n_split = 1;
  // shared-memory plan (persist_plan): bytes of the x staging, offsets of the O and down weights
  int smem_x = 0, off_o = 0, off_down = 0, early_qkv = 0;
};
// MOE_CUDA_PERSIST=1 turns it on (off by default: slower than the per-kernel graph so far; MOE_CUDA_TC=0
// also keeps it off).
bool persist_enabled();
// Checks that the kernel covers the model (Q4_K/Q5_K/Q6_K matrices, an F32 router, attention_supported
// geometry, the shapes of a qwen3moe layer) and that a block's share of each phase's weights fits in
// shared memory; fills a's shared-memory plan and returns the launch shape (one block per SM).
// cudaErrorNotSupported when it does not apply. host_layers is the host copy of the table.
cudaError_t persist_plan(PersistArgs& a, const PersistLayer* host_layers, size_t* smem, int* blocks);
constexpr int kPersistBarriersPerLayer = 6;
// Zeroes the barrier and launches (cooperatively) on s.
cudaError_t decode_persist(const PersistArgs& a, size_t smem, int blocks, cudaStream_t s);

// ---- prefill ----------------------------------------------------------------------------------------
// Y[t][r] (+)= W.row(r) · X[t] for t < n_tok (tiled on the tensor cores at fp32-level accuracy: K-quant codes
// in fp16 against split activations (xh) or on the integer MMA against 24-bit activations, 2xTF32 on
// the codes of Q4_0/Q5_0/Q8_0, 3xTF32 on dequantized floats; see gemm.cu).
// xh (optional): X split by split_h16, which lets Q4_K/Q5_K take the fp16 path (below).
cudaError_t gemm(const Mat& W, const float* X, int x_stride, int n_tok, float* Y, int y_stride, bool accumulate,
                 cudaStream_t s, const void* xh = nullptr);
// The fp16 path of the K-quant prefill GEMMs (gemm_kq.cu): the activations split once per input into
// fp16 hi/lo records (per row and 256 columns: split_h16_bytes), which the GEMM tiles copy as they
// are. split_h16_wanted: W's GEMMs would read such a split (Q4_K/Q5_K/Q6_K, columns a multiple of
// 256, MOE_CUDA_GEMM_H16 not 0).
bool split_h16_wanted(const Mat& W);
size_t split_h16_bytes(int rows, int cols);
cudaError_t split_h16(const float* X, int x_stride, int rows, int cols, void* out, cudaStream_t s);
// rmsnorm_rows (the same floats in out) and split_h16 of its output into rec, in one launch.
cudaError_t rmsnorm_split_h16(const float* x, const float* w, int n, int cols, int stride, float eps, float* out,
                              void* rec, cudaStream_t s);
// Per token: softmax over the router logits, top n_used, renormalised weights.
cudaError_t topk_rows(const float* logits, int n_tok, int n_expert, int n_used, int32_t* ids, float* weights,
                      cudaStream_t s);
// Groups the n_tok * n_used assignments by expert (token order kept within an expert):
// count[e], offset[e], token_of_slot[slot], slot_of[t * n_used + j].
cudaError_t group_by_expert(const int32_t* ids, int n_tok, int n_used, int n_expert, int* count, int* offset,
                            int32_t* token_of_slot, int32_t* slot_of, cudaStream_t s);
// act[slot][r] = silu(G_e.row(r)·h[token_of_slot[slot]]) * (U_e.row(r)·h[...]) for every slot of
// every expert e (tiles of experts with fewer tokens exit at once; max_count bounds the tile grid).
// ticket: a device int, zero, for the K-quant path's dynamic work walk (the call leaves it counted: one
// per call); nullptr: each block takes a fixed share of the tiles.
cudaError_t expert_gate_up_grouped(const Mat& G, const Mat& U, const float* h, int h_stride, const int* count,
                                   const int* offset, const int32_t* token_of_slot, int n_expert, int max_count,
                                   float* act, cudaStream_t s, const void* hh = nullptr, int* ticket = nullptr);
// out[slot][r] = D_e.row(r)·act[slot]. ticket as above.
cudaError_t expert_down_grouped(const Mat& D, const float* act, const int* count, const int* offset, int n_expert,
                                int max_count, float* out, cudaStream_t s, const void* acth = nullptr,
                                int* ticket = nullptr);
// x[t] += Σ_j weights[t][j] * out[slot_of[t][j]] (j in rank order).
cudaError_t combine_experts(const float* out, const int32_t* slot_of, const float* weights, int n_tok, int n_used,
                            int cols, float* x, cudaStream_t s);

}  // namespace moe::cuda::k
