// Properties of the CPU forward that need no reference: a batched prefill gives the logits of
// token-by-token evaluation, chunking and thread count do not change the result, reset() empties
// the cache, and bad requests fail with the documented error categories.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "golden.hpp"
#include "moe/cpu.hpp"
#include "moe/error.hpp"
#include "moe/model.hpp"

namespace {

using moe::quant::ActMode;

std::shared_ptr<const moe::model::OwnedQuantizedModel> open_model(const std::string& stem) {
  return moe::model::OwnedQuantizedModel::open(std::string(MOE_TEST_DATA) + "/" + stem + ".gguf");
}

std::vector<int32_t> sequence() {
  return golden::load(golden::dir(MOE_TEST_DATA, "tiny-qwen3moe-q4_k_m"), "ids_len033").all_ids();  // 57 ids
}

struct Diff {
  double max_abs = 0, min_cos = 1;
};
Diff compare_rows(const std::vector<float>& a, const std::vector<float>& b, int64_t V) {
  Diff d;
  EXPECT_EQ(a.size(), b.size());
  for (size_t r = 0; r * static_cast<size_t>(V) < std::min(a.size(), b.size()); ++r) {
    double ab = 0, aa = 0, bb = 0;
    for (int64_t i = 0; i < V; ++i) {
      const double x = a[r * static_cast<size_t>(V) + static_cast<size_t>(i)];
      const double y = b[r * static_cast<size_t>(V) + static_cast<size_t>(i)];
      ab += x * y;
      aa += x * x;
      bb += y * y;
      d.max_abs = std::max(d.max_abs, std::abs(x - y));
    }
    d.min_cos = std::min(d.min_cos, ab / std::sqrt(aa * bb));
  }
  return d;
}

std::vector<float> token_by_token(moe::Forward& f, const std::vector<int32_t>& ids) {
  std::vector<float> rows, l;
  for (int32_t t : ids) {
    f.eval(std::span<const int32_t>(&t, 1), false, l);
    rows.insert(rows.end(), l.begin(), l.end());
  }
  return rows;
}

class Batch : public testing::TestWithParam<std::tuple<std::string, ActMode>> {
 protected:
  std::shared_ptr<const moe::model::OwnedQuantizedModel> m_ = open_model(std::get<0>(GetParam()));
  moe::quant::ThreadPool pool_{2};
  moe::cpu::Options opts(int64_t max_batch = 512) {
    moe::cpu::Options o;
    o.n_ctx = 128;
    o.mode = std::get<1>(GetParam());
    o.pool = &pool_;
    o.max_batch = max_batch;
    return o;
  }
};

TEST_P(Batch, PrefillMatchesTokenByToken) {
  const std::vector<int32_t> ids = sequence();
  auto batched = moe::cpu::make_forward(m_, opts());
  std::vector<float> all;
  batched->eval(ids, true, all);
  EXPECT_EQ(batched->n_past(), static_cast<int64_t>(ids.size()));
  auto single = moe::cpu::make_forward(m_, opts());
  const std::vector<float> rows = token_by_token(*single, ids);
  const Diff d = compare_rows(all, rows, batched->n_vocab());
  std::printf("[batch] batched vs token-by-token: max |diff| %.3g, min cosine %.9f\n", d.max_abs, d.min_cos);
  EXPECT_LE(d.max_abs, 2e-3);
  EXPECT_GE(d.min_cos, 0.999999);
}

TEST_P(Batch, ChunkingAndLastRowOnly) {
  const std::vector<int32_t> ids = sequence();
  auto whole = moe::cpu::make_forward(m_, opts());
  std::vector<float> all;
  whole->eval(ids, true, all);
  // Chunks of 7 positions: every row, then the last row alone.
  auto chunked = moe::cpu::make_forward(m_, opts(7));
  std::vector<float> all7;
  chunked->eval(ids, true, all7);
  const Diff d = compare_rows(all, all7, whole->n_vocab());
  EXPECT_LE(d.max_abs, 2e-3);
  auto last = moe::cpu::make_forward(m_, opts(7));
  std::vector<float> one;
  last->eval(ids, false, one);
  ASSERT_EQ(static_cast<int64_t>(one.size()), whole->n_vocab());
  const std::vector<float> tail(all.end() - whole->n_vocab(), all.end());
  EXPECT_LE(compare_rows(tail, one, whole->n_vocab()).max_abs, 2e-3);
  // Splitting the sequence over two evals continues from the cache.
  auto split = moe::cpu::make_forward(m_, opts());
  std::vector<float> a, b;
  const size_t half = ids.size() / 2;
  split->eval(std::span<const int32_t>(ids.data(), half), true, a);
  split->eval(std::span<const int32_t>(ids.data() + half, ids.size() - half), true, b);
  a.insert(a.end(), b.begin(), b.end());
  EXPECT_LE(compare_rows(all, a, whole->n_vocab()).max_abs, 2e-3);
}

// Options::router_margins: one value per evaluated position (last-row-only evals included), >= 0,
// the same whether the positions run batched, in chunks or one by one.
TEST_P(Batch, RouterMarginsOnePerPosition) {
  const std::vector<int32_t> ids = sequence();
  std::vector<float> whole_m, chunk_m, single_m;
  moe::cpu::Options o = opts();
  o.router_margins = &whole_m;
  auto whole = moe::cpu::make_forward(m_, o);
  std::vector<float> l;
  whole->eval(ids, true, l);
  o = opts(7);
  o.router_margins = &chunk_m;
  auto chunked = moe::cpu::make_forward(m_, o);
  chunked->eval(ids, true, l);
  // last row only: the other rows skip the last layer's MoE block, so their margins cover fewer layers
  std::vector<float> last_m;
  o.router_margins = &last_m;
  auto last = moe::cpu::make_forward(m_, o);
  last->eval(ids, false, l);
  o = opts();
  o.router_margins = &single_m;
  auto single = moe::cpu::make_forward(m_, o);
  token_by_token(*single, ids);
  ASSERT_EQ(whole_m.size(), ids.size());
  ASSERT_EQ(chunk_m.size(), ids.size());
  ASSERT_EQ(single_m.size(), ids.size());
  ASSERT_EQ(last_m.size(), ids.size());
  float smallest = std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_GE(whole_m[i], 0.f) << "position " << i;
    EXPECT_TRUE(std::isfinite(whole_m[i])) << "position " << i;  // the tiny models use fewer experts than they have
    EXPECT_NEAR(chunk_m[i], whole_m[i], 1e-3) << "position " << i;
    EXPECT_NEAR(single_m[i], whole_m[i], 1e-3) << "position " << i;
    EXPECT_GE(last_m[i], whole_m[i] - 1e-3f) << "position " << i;  // a minimum over fewer layers
    smallest = std::min(smallest, whole_m[i]);
  }
  std::printf("[batch] smallest router margin over %zu positions: %.3g\n", ids.size(), smallest);
}

TEST_P(Batch, ThreadCountDoesNotChangeLogits) {
  const std::vector<int32_t> ids = sequence();
  auto two = moe::cpu::make_forward(m_, opts());
  std::vector<float> a, b;
  two->eval(ids, true, a);
  moe::quant::ThreadPool one_thread(1);
  moe::cpu::Options o = opts();
  o.pool = &one_thread;
  auto one = moe::cpu::make_forward(m_, o);
  one->eval(ids, true, b);
  EXPECT_LE(compare_rows(a, b, two->n_vocab()).max_abs, 1e-4);
}

TEST_P(Batch, ResetStartsOver) {
  const std::vector<int32_t> ids = sequence();
  auto f = moe::cpu::make_forward(m_, opts());
  std::vector<float> first, again;
  f->eval(ids, true, first);
  f->reset();
  EXPECT_EQ(f->n_past(), 0);
  f->eval(ids, true, again);
  EXPECT_EQ(first, again);
}

TEST_P(Batch, GreedyIsArgmax) {
  const std::vector<int32_t> ids = sequence();
  auto a = moe::cpu::make_forward(m_, opts());
  auto b = moe::cpu::make_forward(m_, opts());
  std::vector<float> l;
  a->eval(std::span<const int32_t>(ids.data(), 10), false, l);
  b->eval(std::span<const int32_t>(ids.data(), 10), false, l);
  for (int i = 10; i < 20; ++i) {
    a->eval(std::span<const int32_t>(&ids[static_cast<size_t>(i)], 1), false, l);
    const int32_t want = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    EXPECT_EQ(b->eval_greedy(ids[static_cast<size_t>(i)]), want);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Batch,
                         testing::Combine(testing::Values("tiny-qwen3moe-q8_0", "tiny-qwen3moe-q4_k_m"),
                                          testing::Values(ActMode::fast, ActMode::exact)),
                         [](const testing::TestParamInfo<std::tuple<std::string, ActMode>>& i) {
                           std::string n = std::get<0>(i.param) + (std::get<1>(i.param) == ActMode::fast ? "_fast" : "_exact");
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// ---- errors ---------------------------------------------------------------------------------------
template <class F>
moe::Exit exit_of(F&& f, std::string* msg = nullptr) {
  try {
    f();
  } catch (const moe::Error& e) {
    if (msg) *msg = e.what();
    return e.code();
  }
  return moe::Exit::ok;
}

TEST(CpuForwardErrors, ContextFullIsAResourceError) {
  auto m = open_model("tiny-qwen3moe-q8_0");
  moe::quant::ThreadPool pool(2);
  moe::cpu::Options o;
  o.n_ctx = 8;
  o.pool = &pool;
  auto f = moe::cpu::make_forward(m, o);
  std::vector<int32_t> ids(9, 100);
  std::vector<float> l;
  std::string msg;
  EXPECT_EQ(exit_of([&] { f->eval(ids, false, l); }, &msg), moe::Exit::resources);
  EXPECT_NE(msg.find("8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("9"), std::string::npos) << msg;
  EXPECT_EQ(f->n_past(), 0);
  ids.resize(8);
  EXPECT_EQ(exit_of([&] { f->eval(ids, false, l); }), moe::Exit::ok);
  EXPECT_EQ(exit_of([&] { f->eval_greedy(5); }), moe::Exit::resources);
}

TEST(CpuForwardErrors, TokenOutsideVocabulary) {
  auto m = open_model("tiny-qwen3moe-q8_0");
  moe::quant::ThreadPool pool(1);
  moe::cpu::Options o;
  o.n_ctx = 16;
  o.pool = &pool;
  auto f = moe::cpu::make_forward(m, o);
  std::vector<float> l;
  std::string msg;
  const std::vector<int32_t> bad = {1, 2, 4099};
  EXPECT_EQ(exit_of([&] { f->eval(bad, false, l); }, &msg), moe::Exit::usage);
  EXPECT_NE(msg.find("4099"), std::string::npos) << msg;
  const std::vector<int32_t> negative = {-1};
  EXPECT_EQ(exit_of([&] { f->eval(negative, false, l); }), moe::Exit::usage);
}

TEST(CpuForwardErrors, MissingPoolAndHugeContext) {
  auto m = open_model("tiny-qwen3moe-q8_0");
  moe::cpu::Options o;
  o.n_ctx = 16;
  EXPECT_EQ(exit_of([&] { moe::cpu::make_forward(m, o); }), moe::Exit::usage);
  moe::quant::ThreadPool pool(1);
  o.pool = &pool;
  o.n_ctx = int64_t{1} << 40;  // a KV cache of petabytes
  std::string msg;
  EXPECT_EQ(exit_of([&] { moe::cpu::make_forward(m, o); }, &msg), moe::Exit::resources);
  EXPECT_NE(msg.find("MiB"), std::string::npos) << msg;
}

TEST(CpuForwardErrors, MemoryBytesCoversTheKvCache) {
  auto m = open_model("tiny-qwen3moe-q8_0");
  const auto& c = m->config;
  // 2 layers x 2 (K, V) x 1024 positions x 128 x 2 bytes
  EXPECT_EQ(moe::cpu::kv_bytes(c, 1024), 2u * 2u * 1024u * 128u * 2u);
  EXPECT_GT(moe::cpu::memory_bytes(c, 1024, 512), moe::cpu::kv_bytes(c, 1024));
  EXPECT_GT(moe::cpu::memory_bytes(c, 1024, 512, 2), moe::cpu::memory_bytes(c, 1024, 64, 2));
}

TEST(CpuForwardErrors, NonFiniteLogitsNameThePosition) {
  // The fixture with a NaN in the final norm gain: every logit is NaN.
  const std::string path = std::string(MOE_TEST_DATA) + "/tiny-qwen3moe-q8_0.gguf";
  std::ifstream in(path, std::ios::binary);
  static std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto file = moe::gguf::File::parse(bytes, "nan.gguf");
  const moe::gguf::TensorInfo* t = file->tensor("output_norm.weight");
  ASSERT_NE(t, nullptr);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(bytes.data() + t->file_offset + 8, &nan, 4);
  auto m = moe::model::OwnedQuantizedModel::load(moe::gguf::File::parse(bytes, "nan.gguf"));
  moe::quant::ThreadPool pool(1);
  moe::cpu::Options o;
  o.n_ctx = 16;
  o.pool = &pool;
  auto f = moe::cpu::make_forward(m, o);
  std::vector<float> l;
  const std::vector<int32_t> ids = {10, 20, 30};
  std::string msg;
  EXPECT_EQ(exit_of([&] { f->eval(ids, false, l); }, &msg), moe::Exit::inference);
  EXPECT_NE(msg.find("position 2"), std::string::npos) << msg;
}

}  // namespace
