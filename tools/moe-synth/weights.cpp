// Weight values. Every row has its own random stream derived from (seed, tensor name, row), so the
// bytes do not depend on the thread count or the order rows are produced in.
// The scales follow the recipe of the fixture model (tests/data/FIXTURES.md): inputs of every
// projection have RMS 1 after the RMSNorms, projections are scaled by 1/sqrt(fan_in), so the
// activations stay O(1); the router and the LM head get larger scales with a per-row log-normal
// factor so expert choices are spread but not uniform and the logits have clear peaks.
#include <cmath>

#include "synth.hpp"

namespace synth {
namespace {

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t hash_name(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// splitmix64: one multiply-xorshift chain per 64 random bits; plenty for weights and fast enough
// that the quantizer, not the generator, bounds the writing speed.
struct Rng {
  uint64_t s;
  uint64_t next() { return mix64(s += 0x9E3779B97F4A7C15ull); }
  // Approximately N(0, 1): the sum of four 16-bit uniforms (Irwin-Hall, tails cut at 3.46 sigma).
  float normal() {
    const uint64_t r = next();
    const int64_t sum = int64_t(r & 0xFFFF) + int64_t((r >> 16) & 0xFFFF) + int64_t((r >> 32) & 0xFFFF) +
                        int64_t(r >> 48);
    return static_cast<float>(sum - 131070) * 2.6429129e-05f;  // sqrt(3) / 65536
  }
};

Rng row_rng(uint64_t seed, const std::string& name, int64_t row, uint64_t stream) {
  const uint64_t base = mix64(seed * 0xD1B54A32D192ED03ull ^ hash_name(name) ^ (stream << 56));
  return Rng{mix64(base + static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull)};
}

// exp(sigma * z): a per-row scale drawn from its own stream.
float lognormal(uint64_t seed, const std::string& name, int64_t row, float sigma) {
  Rng r = row_rng(seed, name, row, 1);
  return std::exp(sigma * r.normal());
}

void fill_normal(Rng& r, float* dst, int64_t n, float mean, float stddev) {
  for (int64_t i = 0; i < n; ++i) dst[i] = mean + stddev * r.normal();
}

}  // namespace

bool is_pooled(const Geometry& g, const TensorPlan& t) {
  // At least 3 chunks per row, so rows drawn from a pool of 32768 chunks do not repeat.
  if (t.ne[0] % kPoolChunk != 0 || t.ne[0] < 3 * kPoolChunk) return false;
  switch (t.role) {
    case Role::token_embd:
      return !g.tied;  // tied rows carry a per-token scale
    case Role::attn_q:
    case Role::attn_k:
    case Role::attn_v:
    case Role::attn_output:
    case Role::expert_gate:
    case Role::expert_up:
    case Role::expert_down:
      return true;
    default:
      return false;
  }
}

float pooled_scale(const Geometry& g, const TensorPlan& t) {
  switch (t.role) {
    case Role::token_embd: return 1.f;
    case Role::attn_output: return 0.7f / std::sqrt(static_cast<float>(t.ne[0]));
    case Role::expert_down: return 0.6f / std::sqrt(static_cast<float>(t.ne[0]));
    default: return 1.0f / std::sqrt(static_cast<float>(g.n_embd));
  }
}

std::vector<float> make_unit_pool(uint64_t seed, int64_t n_chunks) {
  std::vector<float> pool(static_cast<size_t>(n_chunks * kPoolChunk));
  for (int64_t c = 0; c < n_chunks; ++c) {
    Rng r = row_rng(seed, "<pool>", c, 2);
    fill_normal(r, pool.data() + c * kPoolChunk, kPoolChunk, 0.f, 1.f);
  }
  return pool;
}

void pooled_row(uint64_t seed, const TensorPlan& t, int64_t row, int64_t n_pool, uint32_t* chunks) {
  Rng r = row_rng(seed, t.name, row, 3);
  const int64_t n = t.ne[0] / kPoolChunk;
  // Multiply-shift maps 32 random bits onto [0, n_pool) without a division.
  for (int64_t j = 0; j < n; ++j)
    chunks[j] = static_cast<uint32_t>(((r.next() >> 32) * static_cast<uint64_t>(n_pool)) >> 32);
}

void generate_row(const Geometry& g, const TensorPlan& t, uint64_t seed, int64_t row, float* dst) {
  Rng r = row_rng(seed, t.name, row, 0);
  const int64_t n = t.ne[0];
  const float inv_sqrt_embd = 1.0f / std::sqrt(static_cast<float>(g.n_embd));
  switch (t.role) {
    case Role::token_embd: {
      // Tied: the rows are also the LM head, so they get the head's per-token spread.
      const float s = g.tied ? lognormal(seed, t.name, row, 0.4f) : 1.0f;
      fill_normal(r, dst, n, 0.f, s);
      break;
    }
    case Role::output:
      fill_normal(r, dst, n, 0.f, 4.f * inv_sqrt_embd * lognormal(seed, t.name, row, 0.4f));
      break;
    case Role::output_norm:
      // Tied: N(0,1) embedding rows against an RMS-1 hidden state would give logits of std sqrt(n_embd);
      // the final norm's gain brings them to the same ~4 as the untied head.
      if (g.tied)
        fill_normal(r, dst, n, 4.f * inv_sqrt_embd, 0.4f * inv_sqrt_embd);
      else
        fill_normal(r, dst, n, 1.f, 0.1f);
      break;
    case Role::attn_norm:
    case Role::ffn_norm:
    case Role::qk_norm:
      fill_normal(r, dst, n, 1.f, 0.1f);
      break;
    case Role::router:
      fill_normal(r, dst, n, 0.f, 3.f * inv_sqrt_embd * lognormal(seed, t.name, row, 0.3f));
      break;
    default:  // the pooled roles, for rows that are not whole pool chunks
      fill_normal(r, dst, n, 0.f, pooled_scale(g, t));
      break;
  }
}

}  // namespace synth
