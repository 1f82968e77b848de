// moe-synth models are numerically sane: the CPU forward gives finite, peaked logits through many
// layers, and the routers spread tokens over the experts without being uniform.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "moe/cpu.hpp"
#include "moe/model.hpp"
#include "moe/quant.hpp"
#include "synth_util.hpp"

namespace {

using namespace synth_test;

struct RowStats {
  double std = 0, peak = 0;  // peak: (max - mean) / std
};
RowStats row_stats(const float* l, int64_t n) {
  double mean = 0, sq = 0, mx = -1e30;
  for (int64_t i = 0; i < n; ++i) mean += l[i], mx = std::max<double>(mx, l[i]);
  mean /= double(n);
  for (int64_t i = 0; i < n; ++i) sq += (l[i] - mean) * (l[i] - mean);
  RowStats s;
  s.std = std::sqrt(sq / double(n));
  s.peak = s.std > 0 ? (mx - mean) / s.std : 0;
  return s;
}

TEST(SynthNumerics, LogitsAreFiniteAndPeaked) {
  const std::pair<const char*, const char*> cases[] = {
      {"num-tiny.gguf", "--preset tiny --type q4_k_m"},
      {"num-deep.gguf",
       "--layers 12 --embd 512 --heads 8 --kv-heads 2 --head-dim 64 --experts 16 --experts-used 4 --expert-ffn 256 "
       "--vocab-size 2000 --type q8_0"},
      {"num-tied.gguf", "--layers 4 --tied --type f16"},
  };
  for (const auto& [name, args] : cases) {
    const auto m = moe::model::OwnedQuantizedModel::open(make_model(name, args));
    moe::quant::ThreadPool pool(2);
    moe::cpu::Options o;
    o.n_ctx = 64;
    o.pool = &pool;
    auto fwd = moe::cpu::make_forward(m, o);
    std::vector<int32_t> ids(32);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 7919 + 13) % 1000);
    std::vector<float> logits;
    fwd->eval(ids, true, logits);
    const int64_t V = fwd->n_vocab();
    ASSERT_EQ(logits.size(), ids.size() * static_cast<size_t>(V));
    std::vector<double> stds, peaks;
    std::vector<int> argmax;
    for (size_t r = 0; r < ids.size(); ++r) {
      const float* l = logits.data() + r * V;
      for (int64_t i = 0; i < V; ++i) ASSERT_TRUE(std::isfinite(l[i])) << name << " row " << r;
      const auto s = row_stats(l, V);
      stds.push_back(s.std);
      peaks.push_back(s.peak);
      argmax.push_back(static_cast<int>(std::max_element(l, l + V) - l));
    }
    std::sort(stds.begin(), stds.end());
    std::sort(peaks.begin(), peaks.end());
    const double med_std = stds[stds.size() / 2], med_peak = peaks[peaks.size() / 2];
    std::printf("%s: median logit std %.2f, median peak %.2f sigma\n", name, med_std, med_peak);
    // Logits of a few units: neither washed out nor saturated after every layer.
    EXPECT_GT(med_std, 1.0) << name;
    EXPECT_LT(med_std, 20.0) << name;
    // The best token stands well clear of the bulk.
    EXPECT_GT(med_peak, 4.0) << name;
    // Different contexts pick different tokens.
    std::sort(argmax.begin(), argmax.end());
    EXPECT_GT(std::unique(argmax.begin(), argmax.end()) - argmax.begin(), 4) << name;
  }
}

// Router logits for normalized token embeddings (the layer-0 router input without the attention
// residual): top-k picks should reach most experts, none of them for nearly every token.
TEST(SynthNumerics, RouterChoicesSpreadButNotUniform) {
  const auto m = moe::model::OwnedQuantizedModel::open(make_model(
      "num-router.gguf",
      "--layers 1 --embd 512 --heads 4 --kv-heads 2 --head-dim 128 --experts 32 --experts-used 4 --expert-ffn 256 "
      "--vocab-size 3000 --type q8_0"));
  const auto& c = m->config;
  const auto& L = m->layers[0];
  const int64_t E = c.n_embd, X = c.n_expert, K = c.n_expert_used;
  std::vector<float> x(E), norm(E), logits(X), router(E * X);
  std::memcpy(norm.data(), L.ffn_norm.data, E * 4);
  std::memcpy(router.data(), L.ffn_gate_inp.data, E * X * 4);
  std::vector<int> count(X, 0);
  const int tokens = 2000;
  double top_prob_sum = 0;
  for (int t = 0; t < tokens; ++t) {
    const auto emb = m->token_embd.matrix();
    moe::quant::dequantize_row(emb.type, emb.row(t), x.data(), E);
    double ms = 0;
    for (float v : x) ms += double(v) * v;
    const float inv = 1.f / std::sqrt(float(ms / E) + c.rms_eps);
    for (int64_t i = 0; i < E; ++i) x[i] *= inv * norm[i];
    for (int64_t e = 0; e < X; ++e) {
      double s = 0;
      for (int64_t i = 0; i < E; ++i) s += double(router[e * E + i]) * x[i];
      logits[e] = float(s);
    }
    std::vector<int> order(X);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [&](int a, int b) { return logits[a] > logits[b]; });
    for (int k = 0; k < K; ++k) ++count[order[k]];
    double z = 0;
    for (float v : logits) z += std::exp(double(v - logits[order[0]]));
    top_prob_sum += 1.0 / z;
  }
  const int used = static_cast<int>(std::count_if(count.begin(), count.end(), [](int n) { return n > 0; }));
  EXPECT_GE(used, X * 3 / 4);
  const int most = *std::max_element(count.begin(), count.end());
  EXPECT_LT(most, tokens * 3 / 4);
  // Not uniform: the busiest expert gets clearly more than its even share K/X.
  EXPECT_GT(most, tokens * K / X * 3 / 2);
  // The router is confident but not one-hot: mean top-1 softmax probability between 1/X and 0.95.
  const double top = top_prob_sum / tokens;
  std::printf("experts used %d/%ld, busiest %d of %d picks, mean top-1 probability %.3f\n", used, long(X), most,
              tokens * int(K), top);
  EXPECT_GT(top, 2.0 / X);
  EXPECT_LT(top, 0.95);
}

}  // namespace
