#include "golden.hpp"

#include <stdexcept>

#include "json_lite.hpp"
#include "npy.hpp"

namespace golden {

std::vector<int32_t> Run::all_ids() const {
  std::vector<int32_t> ids = prompt_ids;
  ids.insert(ids.end(), generated_ids.begin(), generated_ids.end());
  return ids;
}

std::string dir(const std::string& data_dir, const std::string& model_stem) {
  return data_dir + "/golden/" + model_stem;
}

std::vector<std::string> run_names(const std::string& golden_dir) {
  const json_lite::Value idx = json_lite::load(golden_dir + "/index.json");
  std::vector<std::string> names;
  for (const json_lite::Value& r : idx.at("runs").arr) names.push_back(r.at("name").str);
  return names;
}

Run load(const std::string& golden_dir, const std::string& run) {
  const std::string base = golden_dir + "/" + run;
  const json_lite::Value j = json_lite::load(base + ".json");
  Run r;
  r.name = j.at("name").str;
  r.n_vocab = static_cast<int64_t>(j.at("n_vocab").num);
  r.n_prompt = static_cast<int64_t>(j.at("n_prompt").num);
  r.n_generated = static_cast<int64_t>(j.at("n_generated").num);
  r.prompt_ids = j.at("prompt_ids").ints();
  r.generated_ids = j.at("generated_ids").ints();
  r.row_top2_margin = j.at("row_top2_margin").numbers();
  r.row_router_margin = j.at("row_router_margin").numbers();
  r.topk = static_cast<int64_t>(j.at("topk").num);

  const npy::Array logits = npy::load(base + ".npy");
  if (logits.shape.size() != 2 || logits.shape[1] != r.n_vocab)
    throw std::runtime_error(base + ".npy: expected [rows, n_vocab] logits");
  r.n_rows = logits.shape[0];
  r.logits = logits.as_f32();
  const npy::Array ids = npy::load(base + ".topk_ids.npy");
  const npy::Array tl = npy::load(base + ".topk_logits.npy");
  if (ids.shape != std::vector<int64_t>{r.n_rows, r.topk} || tl.shape != ids.shape)
    throw std::runtime_error(base + ": top-k arrays do not match the logits");
  for (int64_t v : ids.as_i64()) r.topk_ids.push_back(static_cast<int32_t>(v));
  r.topk_logits = tl.as_f32();
  if (static_cast<int64_t>(r.row_router_margin.size()) != r.n_rows ||
      static_cast<int64_t>(r.row_top2_margin.size()) != r.n_rows ||
      r.n_rows != r.n_prompt + r.n_generated)
    throw std::runtime_error(base + ".json: per-row fields do not match the logits rows");
  return r;
}

}  // namespace golden
