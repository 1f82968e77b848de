// The exact (FP32-activation) mode against an independent double-precision forward written plainly
// here from the dequantized weights (REFERENCE.md §4: K/V rounded to fp16, nothing else quantized).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "golden.hpp"
#include "moe/cpu.hpp"
#include "moe/model.hpp"

namespace {

using moe::model::Tensor;

struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<float> w;  // dequantized, row-major [rows][cols]
  std::vector<double> mul(const std::vector<double>& x) const {
    std::vector<double> y(static_cast<size_t>(rows), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      double acc = 0.0;
      for (int64_t c = 0; c < cols; ++c) acc += static_cast<double>(w[static_cast<size_t>(r * cols + c)]) * x[static_cast<size_t>(c)];
      y[static_cast<size_t>(r)] = acc;
    }
    return y;
  }
};

Mat dequant(const moe::quant::Matrix& m) {
  Mat out;
  out.rows = m.rows;
  out.cols = m.cols;
  out.w.resize(static_cast<size_t>(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r) moe::quant::dequantize_row(m.type, m.row(r), out.w.data() + r * m.cols, m.cols);
  return out;
}

std::vector<double> vec(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.ne[0]));
  for (size_t i = 0; i < v.size(); ++i) v[i] = t.f32()[i];
  return v;
}

std::vector<double> rmsnorm(const std::vector<double>& x, const std::vector<double>& w, double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double scale = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * scale * w[i];
  return y;
}

double to_f16(double v) { return static_cast<double>(static_cast<_Float16>(static_cast<float>(v))); }

struct RefLayer {
  std::vector<double> attn_norm, q_norm, k_norm, ffn_norm;
  Mat wq, wk, wv, wo, router;
  std::vector<Mat> gate, up, down;
};

struct RefModel {
  moe::model::ModelConfig c;
  Mat embd, out;
  std::vector<double> out_norm;
  std::vector<RefLayer> layers;
};

RefModel load_ref(const moe::model::OwnedQuantizedModel& m) {
  RefModel r;
  r.c = m.config;
  r.embd = dequant(m.token_embd.matrix());
  r.out = dequant(m.output.matrix());
  r.out_norm = vec(m.output_norm);
  for (const moe::model::Layer& L : m.layers) {
    RefLayer l;
    l.attn_norm = vec(L.attn_norm);
    l.q_norm = vec(L.attn_q_norm);
    l.k_norm = vec(L.attn_k_norm);
    l.ffn_norm = vec(L.ffn_norm);
    l.wq = dequant(L.attn_q.matrix());
    l.wk = dequant(L.attn_k.matrix());
    l.wv = dequant(L.attn_v.matrix());
    l.wo = dequant(L.attn_output.matrix());
    l.router = dequant(L.ffn_gate_inp.matrix());
    for (int64_t e = 0; e < m.config.n_expert; ++e) {
      l.gate.push_back(dequant(L.ffn_gate_exps.expert(e)));
      l.up.push_back(dequant(L.ffn_up_exps.expert(e)));
      l.down.push_back(dequant(L.ffn_down_exps.expert(e)));
    }
    r.layers.push_back(std::move(l));
  }
  return r;
}

// Logits of every position of `ids`; router_margin[t]: smallest ln p_k - ln p_(k+1) over the layers.
std::vector<std::vector<double>> ref_forward(const RefModel& m, const std::vector<int32_t>& ids,
                                             std::vector<double>& router_margin) {
  const auto& c = m.c;
  const int64_t n = static_cast<int64_t>(ids.size()), E = c.n_embd, hd = c.head_dim, nh = c.n_head,
                nkv = c.n_head_kv, X = c.n_expert, K = c.n_expert_used;
  const double eps = c.rms_eps;
  std::vector<std::vector<double>> x(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    const float* row = m.embd.w.data() + static_cast<int64_t>(ids[static_cast<size_t>(t)]) * E;
    x[static_cast<size_t>(t)].assign(row, row + E);
  }
  router_margin.assign(static_cast<size_t>(n), 1e30);
  for (const RefLayer& L : m.layers) {
    std::vector<std::vector<double>> q(static_cast<size_t>(n)), k(static_cast<size_t>(n)), v(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) {
      const std::vector<double> h = rmsnorm(x[static_cast<size_t>(t)], L.attn_norm, eps);
      q[static_cast<size_t>(t)] = L.wq.mul(h);
      k[static_cast<size_t>(t)] = L.wk.mul(h);
      v[static_cast<size_t>(t)] = L.wv.mul(h);
      auto norm_rope = [&](std::vector<double>& z, int64_t heads, const std::vector<double>& w) {
        for (int64_t i = 0; i < heads; ++i) {
          std::vector<double> head(z.begin() + i * hd, z.begin() + (i + 1) * hd);
          head = rmsnorm(head, w, eps);
          for (int64_t d = 0; d < hd / 2; ++d) {
            const double theta = static_cast<double>(t) * std::pow(static_cast<double>(c.rope_base), -2.0 * d / hd);
            const double a = head[static_cast<size_t>(d)], b = head[static_cast<size_t>(d + hd / 2)];
            head[static_cast<size_t>(d)] = a * std::cos(theta) - b * std::sin(theta);
            head[static_cast<size_t>(d + hd / 2)] = a * std::sin(theta) + b * std::cos(theta);
          }
          std::copy(head.begin(), head.end(), z.begin() + i * hd);
        }
      };
      norm_rope(q[static_cast<size_t>(t)], nh, L.q_norm);
      norm_rope(k[static_cast<size_t>(t)], nkv, L.k_norm);
      for (double& e : k[static_cast<size_t>(t)]) e = to_f16(e);
      for (double& e : v[static_cast<size_t>(t)]) e = to_f16(e);
    }
    for (int64_t t = 0; t < n; ++t) {
      std::vector<double> att(static_cast<size_t>(nh * hd), 0.0);
      for (int64_t i = 0; i < nh; ++i) {
        const int64_t g = i / (nh / nkv);
        std::vector<double> s(static_cast<size_t>(t + 1));
        double mx = -1e300;
        for (int64_t p = 0; p <= t; ++p) {
          double d = 0;
          for (int64_t j = 0; j < hd; ++j)
            d += q[static_cast<size_t>(t)][static_cast<size_t>(i * hd + j)] * k[static_cast<size_t>(p)][static_cast<size_t>(g * hd + j)];
          s[static_cast<size_t>(p)] = d / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[static_cast<size_t>(p)]);
        }
        double sum = 0;
        for (double& e : s) sum += (e = std::exp(e - mx));
        for (int64_t p = 0; p <= t; ++p)
          for (int64_t j = 0; j < hd; ++j)
            att[static_cast<size_t>(i * hd + j)] += s[static_cast<size_t>(p)] / sum * v[static_cast<size_t>(p)][static_cast<size_t>(g * hd + j)];
      }
      const std::vector<double> o = L.wo.mul(att);
      std::vector<double>& xt = x[static_cast<size_t>(t)];
      for (int64_t e = 0; e < E; ++e) xt[static_cast<size_t>(e)] += o[static_cast<size_t>(e)];

      const std::vector<double> h = rmsnorm(xt, L.ffn_norm, eps);
      std::vector<double> r = L.router.mul(h);
      const double rmax = *std::max_element(r.begin(), r.end());
      double rsum = 0;
      for (double& e : r) rsum += (e = std::exp(e - rmax));
      for (double& e : r) e /= rsum;
      std::vector<int> order(static_cast<size_t>(X));
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int b) {
        const double pa = r[static_cast<size_t>(a)], pb = r[static_cast<size_t>(b)];
        return pa > pb || (pa == pb && a < b);  // ties: lower id first
      });
      if (K < X)
        router_margin[static_cast<size_t>(t)] =
            std::min(router_margin[static_cast<size_t>(t)],
                     std::log(r[static_cast<size_t>(order[static_cast<size_t>(K - 1)])]) - std::log(r[static_cast<size_t>(order[static_cast<size_t>(K)])]));
      double wsum = 0;
      for (int64_t j = 0; j < K; ++j) wsum += r[static_cast<size_t>(order[static_cast<size_t>(j)])];
      for (int64_t j = 0; j < K; ++j) {
        const int e = order[static_cast<size_t>(j)];
        const double w = r[static_cast<size_t>(e)] / wsum;
        const std::vector<double> g = L.gate[static_cast<size_t>(e)].mul(h);
        const std::vector<double> u = L.up[static_cast<size_t>(e)].mul(h);
        std::vector<double> a(g.size());
        for (size_t i = 0; i < g.size(); ++i) a[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
        const std::vector<double> d = L.down[static_cast<size_t>(e)].mul(a);
        for (int64_t i = 0; i < E; ++i) xt[static_cast<size_t>(i)] += w * d[static_cast<size_t>(i)];
      }
    }
  }
  std::vector<std::vector<double>> logits;
  for (int64_t t = 0; t < n; ++t) logits.push_back(m.out.mul(rmsnorm(x[static_cast<size_t>(t)], m.out_norm, eps)));
  return logits;
}

class ExactVsDouble : public testing::TestWithParam<std::string> {};

TEST_P(ExactVsDouble, ExactModeMatchesDoubleReference) {
  auto m = moe::model::OwnedQuantizedModel::open(std::string(MOE_TEST_DATA) + "/" + GetParam() + ".gguf");
  ASSERT_EQ(m->config.rope_scaling, moe::model::RopeScalingType::none);  // the reference has plain RoPE
  const RefModel ref = load_ref(*m);
  const golden::Run run = golden::load(golden::dir(MOE_TEST_DATA, GetParam()), "ids_len100");
  const std::vector<int32_t> ids = run.all_ids();

  std::vector<double> margin;
  const std::vector<std::vector<double>> want = ref_forward(ref, ids, margin);

  moe::quant::ThreadPool pool(2);
  moe::cpu::Options o;
  o.n_ctx = 256;
  o.mode = moe::quant::ActMode::exact;
  o.pool = &pool;
  auto f = moe::cpu::make_forward(m, o);
  std::vector<float> got;
  f->eval(ids, true, got);
  const int64_t V = f->n_vocab();
  ASSERT_EQ(got.size(), ids.size() * static_cast<size_t>(V));

  double min_cos = 1.0, max_abs = 0.0;
  int skipped = 0;
  for (size_t t = 0; t < ids.size(); ++t) {
    if (margin[t] < 1e-3) {  // an fp32 rounding may pick the other expert here
      ++skipped;
      continue;
    }
    double ab = 0, aa = 0, bb = 0;
    for (int64_t i = 0; i < V; ++i) {
      const double a = got[t * static_cast<size_t>(V) + static_cast<size_t>(i)], b = want[t][static_cast<size_t>(i)];
      ab += a * b;
      aa += a * a;
      bb += b * b;
      max_abs = std::max(max_abs, std::abs(a - b));
    }
    const double cos = ab / std::sqrt(aa * bb);
    min_cos = std::min(min_cos, cos);
    EXPECT_GE(cos, 0.99999) << "position " << t;
  }
  std::printf("[exact-vs-double] %s: %zu positions, min cosine %.8f, max |diff| %.3g, %d near-tie positions skipped\n",
              GetParam().c_str(), ids.size(), min_cos, max_abs, skipped);
  EXPECT_LT(skipped, 5);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ExactVsDouble, testing::Values("tiny-qwen3moe-q8_0", "tiny-qwen3moe-q4_k_m"),
                         [](const testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
