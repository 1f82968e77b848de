// The CPU forward against llama.cpp's logits on the fixture models (tests/data/FIXTURES.md):
// the golden token sequence goes through the forward (prompt in one batch with every row's logits,
// then the generated tokens one at a time) and every row whose router is not near a tie is compared.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "golden.hpp"
#include "test_util.hpp"
#include "moe/cpu.hpp"
#include "moe/model.hpp"

namespace {

constexpr double kRouterMarginMin = 0.05;  // rows below: the expert choice may flip (reported apart)
constexpr double kTop2MarginMin = 0.3;     // greedy must agree at least up to the first step below this

using test_util::cosine;

// Rows [n_prompt + n_generated][n_vocab] of the forward over the golden sequence.
std::vector<float> golden_sequence_logits(moe::Forward& f, const golden::Run& r) {
  const int64_t V = r.n_vocab;
  std::vector<float> rows;
  std::vector<float> logits;
  f.eval(r.prompt_ids, true, logits);
  rows.insert(rows.end(), logits.begin(), logits.end());
  for (int32_t tok : r.generated_ids) {
    f.eval(std::span<const int32_t>(&tok, 1), false, logits);
    EXPECT_EQ(static_cast<int64_t>(logits.size()), V);
    rows.insert(rows.end(), logits.begin(), logits.end());
  }
  return rows;
}

struct Case {
  std::string model;  // file stem in tests/data
  moe::quant::ActMode mode;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  std::string n = info.param.model + (info.param.mode == moe::quant::ActMode::fast ? "_fast" : "_exact");
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

class Conformance : public testing::TestWithParam<Case> {};

TEST_P(Conformance, LogitsMatchLlamaCpp) {
  const Case& c = GetParam();
  const bool fast = c.mode == moe::quant::ActMode::fast;
  auto m = moe::model::OwnedQuantizedModel::open(std::string(MOE_TEST_DATA) + "/" + c.model + ".gguf");
  moe::quant::ThreadPool pool(2);
  moe::cpu::Options o;
  o.n_ctx = 512;
  o.mode = c.mode;
  o.pool = &pool;
  const std::string gdir = golden::dir(MOE_TEST_DATA, c.model);

  double min_cos = 1.0, max_top_diff = 0.0, min_cos_tie = 1.0, max_top_diff_tie = 0.0;
  int judged = 0, ties = 0, rows_total = 0;
  std::string tie_list;
  for (const std::string& name : golden::run_names(gdir)) {
    const golden::Run r = golden::load(gdir, name);
    auto f = moe::cpu::make_forward(m, o);
    ASSERT_EQ(f->n_vocab(), r.n_vocab);
    const std::vector<float> rows = golden_sequence_logits(*f, r);
    ASSERT_EQ(static_cast<int64_t>(rows.size()), r.n_rows * r.n_vocab);
    rows_total += static_cast<int>(r.n_rows);
    for (int64_t p = 0; p < r.n_rows; ++p) {
      const float* ours = rows.data() + p * r.n_vocab;
      const double cos = cosine(ours, r.row(p), r.n_vocab);
      double top = 0.0;
      for (int64_t k = 0; k < r.topk; ++k) {
        const int32_t id = r.topk_ids[static_cast<size_t>(p * r.topk + k)];
        top = std::max(top, std::abs(static_cast<double>(ours[id]) - r.topk_logits[static_cast<size_t>(p * r.topk + k)]));
      }
      if (r.row_router_margin[static_cast<size_t>(p)] >= kRouterMarginMin) {
        ++judged;
        min_cos = std::min(min_cos, cos);
        max_top_diff = std::max(max_top_diff, top);
        if (fast) {
          EXPECT_GE(cos, 0.9995) << name << " position " << p;
          EXPECT_LE(top, 1.5) << name << " position " << p;
        } else {
          EXPECT_GE(cos, 0.999) << name << " position " << p;
        }
      } else {
        ++ties;
        min_cos_tie = std::min(min_cos_tie, cos);
        max_top_diff_tie = std::max(max_top_diff_tie, top);
        char buf[96];
        std::snprintf(buf, sizeof buf, " %s@%lld(cos %.5f)", name.c_str(), static_cast<long long>(p), cos);
        tie_list += buf;
      }
    }
  }
  std::printf("[conformance] %s %s: %d rows judged: min cosine %.6f, max |diff| at llama.cpp's top-64 %.4f\n",
              c.model.c_str(), fast ? "fast" : "exact", judged, min_cos, max_top_diff);
  std::printf("[conformance] %d near-tie rows (router margin < %.2f): min cosine %.6f, max top-64 diff %.4f:%s\n",
              ties, kRouterMarginMin, min_cos_tie, max_top_diff_tie, tie_list.c_str());
  EXPECT_GT(judged, rows_total * 3 / 4);  // near ties stay the exception
  if (fast) {
    // At least as close as llama.cpp itself with flash attention on against these goldens
    // (issue 5: cosine >= 0.99987, top-64 differences <= 0.61).
    EXPECT_GE(min_cos, 0.99987);
    EXPECT_LE(max_top_diff, 0.61);
  }
}

TEST_P(Conformance, GreedyMatchesGoldenTokens) {
  const Case& c = GetParam();
  auto m = moe::model::OwnedQuantizedModel::open(std::string(MOE_TEST_DATA) + "/" + c.model + ".gguf");
  moe::quant::ThreadPool pool(2);
  moe::cpu::Options o;
  o.n_ctx = 512;
  o.mode = c.mode;
  o.pool = &pool;
  const std::string gdir = golden::dir(MOE_TEST_DATA, c.model);
  int total_required = 0, total_agree = 0;
  for (const std::string& name : golden::run_names(gdir)) {
    const golden::Run r = golden::load(gdir, name);
    // Steps before the first near-tie of the top-2 logits must agree.
    int64_t required = r.n_generated;
    for (int64_t s = 0; s < r.n_generated; ++s)
      if (r.row_top2_margin[static_cast<size_t>(r.n_prompt - 1 + s)] < kTop2MarginMin) {
        required = s;
        break;
      }
    auto f = moe::cpu::make_forward(m, o);
    std::vector<float> logits;
    f->eval(r.prompt_ids, false, logits);
    int32_t tok = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    int64_t agree = 0;
    for (int64_t s = 0; s < r.n_generated; ++s) {
      if (tok != r.generated_ids[static_cast<size_t>(s)]) break;
      ++agree;
      if (s + 1 < r.n_generated) tok = f->eval_greedy(tok);
    }
    EXPECT_GE(agree, required) << name << ": greedy diverged at step " << agree << " (must agree up to " << required
                               << ")";
    total_required += static_cast<int>(required);
    total_agree += static_cast<int>(agree);
  }
  std::printf("[greedy] %s: %d golden steps reproduced in a row (required %d)\n", c.model.c_str(), total_agree,
              total_required);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Conformance,
                         testing::Values(Case{"tiny-qwen3moe-q8_0", moe::quant::ActMode::fast},
                                         Case{"tiny-qwen3moe-q8_0", moe::quant::ActMode::exact},
                                         Case{"tiny-qwen3moe-q4_k_m", moe::quant::ActMode::fast},
                                         Case{"tiny-qwen3moe-q4_k_m", moe::quant::ActMode::exact}),
                         case_name);

}  // namespace
