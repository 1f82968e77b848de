// The llama.cpp reference outputs of tests/data/golden/<model>/ (layout in tests/data/FIXTURES.md).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace golden {

struct Run {
  std::string name;
  int64_t n_vocab = 0, n_prompt = 0, n_generated = 0;
  std::vector<int32_t> prompt_ids, generated_ids;
  std::vector<double> row_top2_margin, row_router_margin;  // per row (position)
  int64_t n_rows = 0;
  std::vector<float> logits;       // [n_rows][n_vocab]
  int64_t topk = 0;
  std::vector<int32_t> topk_ids;   // [n_rows][topk], descending logit
  std::vector<float> topk_logits;  // [n_rows][topk]

  const float* row(int64_t p) const { return logits.data() + p * n_vocab; }
  std::vector<int32_t> all_ids() const;  // prompt followed by generated
};

// Directory of a model's goldens: MOE_TEST_DATA "/golden/" + model stem.
std::string dir(const std::string& data_dir, const std::string& model_stem);
// Run names listed in the directory's index.json, in order.
std::vector<std::string> run_names(const std::string& golden_dir);
Run load(const std::string& golden_dir, const std::string& run);

}  // namespace golden
