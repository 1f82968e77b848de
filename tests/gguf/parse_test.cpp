// The parser on the fixtures: shapes, types, offsets and byte sizes against values the test computes
// itself from the block geometry of REFERENCE.md §1.6 (a table kept here, not the library's).
#include <gtest/gtest.h>

#include <map>

#include "gguf_image.hpp"
#include "moe/gguf.hpp"

namespace {

using moe::gguf::File;

const std::string kData = MOE_TEST_DATA;

struct Geometry {
  uint64_t block_elems, block_bytes;
};
// Block geometry from REFERENCE.md §1.6, written out independently of src/gguf/types.cpp.
const std::map<uint32_t, Geometry> kGeom = {
    {0, {1, 4}}, {1, {1, 2}}, {8, {32, 34}}, {12, {256, 144}}, {13, {256, 176}}, {14, {256, 210}}, {30, {1, 2}}};

void check_table(const std::string& path) {
  auto f = File::open(path);
  auto bytes = gguf_test::read_file(path);
  auto img = gguf_test::Image::read(bytes);
  ASSERT_EQ(f->tensors().size(), img.tensors.size());
  EXPECT_EQ(f->file_size(), bytes.size());
  EXPECT_EQ(f->version(), img.version);
  uint64_t data_start = bytes.size() - img.data.size();
  EXPECT_EQ(f->data_offset(), data_start);
  for (const auto& rec : img.tensors) {
    const auto* t = f->tensor(rec.name);
    ASSERT_NE(t, nullptr) << rec.name;
    ASSERT_EQ(t->n_dims, rec.ne.size());
    uint64_t n = 1;
    for (size_t d = 0; d < rec.ne.size(); ++d) {
      EXPECT_EQ(t->ne[d], rec.ne[d]);
      n *= static_cast<uint64_t>(rec.ne[d]);
    }
    EXPECT_EQ(static_cast<uint32_t>(t->type), rec.type);
    ASSERT_TRUE(kGeom.count(rec.type)) << "fixture uses an unexpected type " << rec.type;
    Geometry g = kGeom.at(rec.type);
    EXPECT_EQ(t->nbytes, n / g.block_elems * g.block_bytes) << rec.name;
    EXPECT_EQ(t->offset, rec.offset);
    EXPECT_EQ(t->offset % f->alignment(), 0u);
    EXPECT_EQ(t->data, f->bytes() + data_start + rec.offset);
    EXPECT_LE(data_start + rec.offset + t->nbytes, bytes.size());
  }
}

TEST(GgufParse, FixtureQ8TensorTable) { check_table(kData + "/tiny-qwen3moe-q8_0.gguf"); }
TEST(GgufParse, FixtureQ4KMTensorTable) { check_table(kData + "/tiny-qwen3moe-q4_k_m.gguf"); }

TEST(GgufParse, FixtureTypesMatchTheFixtureReadme) {
  // FIXTURES.md: Q4_K_M file has F32 x11, Q4_K x8, Q5_K x2, Q6_K x2, Q8_0 x4; Q8_0 file F32 x11, Q8_0 x16.
  auto count = [](const std::string& p) {
    std::map<std::string, int> c;
    const auto f = File::open(p);  // held: a range-for over a temporary's member outlives the temporary
    for (const auto& t : f->tensors()) c[moe::gguf::type_name(t.type)]++;
    return c;
  };
  std::map<std::string, int> q4 = {{"F32", 11}, {"Q4_K", 8}, {"Q5_K", 2}, {"Q6_K", 2}, {"Q8_0", 4}};
  std::map<std::string, int> q8 = {{"F32", 11}, {"Q8_0", 16}};
  EXPECT_EQ(count(kData + "/tiny-qwen3moe-q4_k_m.gguf"), q4);
  EXPECT_EQ(count(kData + "/tiny-qwen3moe-q8_0.gguf"), q8);
  auto f = File::open(kData + "/tiny-qwen3moe-q4_k_m.gguf");
  EXPECT_EQ(f->tensor("blk.0.ffn_down_exps.weight")->type, moe::gguf::Type::Q4_K);
  EXPECT_EQ(f->tensor("blk.1.ffn_down_exps.weight")->type, moe::gguf::Type::Q6_K);
  EXPECT_EQ(f->tensor("blk.1.ffn_down_exps.weight")->shape_string(), "[256, 256, 8]");
}

TEST(GgufParse, MetadataAccessors) {
  auto f = File::open(kData + "/tiny-qwen3moe-q8_0.gguf");
  EXPECT_EQ(f->get_string("general.architecture"), "qwen3moe");
  EXPECT_EQ(f->get_u32("qwen3moe.block_count"), 2u);
  EXPECT_EQ(f->get_u32("qwen3moe.embedding_length"), 256u);
  EXPECT_FLOAT_EQ(f->get_f32("qwen3moe.rope.freq_base"), 1000000.f);
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.tokens").size(), 4099u);
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.tokens")[4097], "<|im_start|>");
  const auto& tt = f->get_array("tokenizer.ggml.token_type", moe::gguf::ValueType::INT32);
  EXPECT_EQ(tt.count, 4099u);
  EXPECT_EQ(tt.int_at(4098), 3);  // <|im_end|> is CONTROL
  EXPECT_EQ(tt.int_at(0), 1);
  EXPECT_FALSE(f->opt_u32("qwen3moe.no_such_key").has_value());
}

TEST(GgufParse, TypedAccessorErrorsNameKeyAndTypes) {
  auto f = File::open(kData + "/tiny-qwen3moe-q8_0.gguf");
  try {
    f->get_f32("qwen3moe.block_count");
    FAIL() << "no error";
  } catch (const moe::Error& e) {
    EXPECT_EQ(e.code(), moe::Exit::unsupported);
    std::string m = e.what();
    EXPECT_NE(m.find("qwen3moe.block_count"), std::string::npos) << m;
    EXPECT_NE(m.find("FLOAT32"), std::string::npos) << m;
    EXPECT_NE(m.find("UINT32"), std::string::npos) << m;
  }
  try {
    f->get_u32("qwen3moe.expert_countx");
    FAIL() << "no error";
  } catch (const moe::Error& e) {
    EXPECT_EQ(std::string(e.what()), "'qwen3moe.expert_countx' is missing from the GGUF metadata");
  }
}

TEST(GgufParse, VocabOnlyFileParses) {
  auto f = File::open(kData + "/ggml-vocab-qwen2.gguf");
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.tokens").size(), 151936u);
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.merges").size(), 151387u);
  EXPECT_TRUE(f->tensors().empty());
}

}  // namespace
