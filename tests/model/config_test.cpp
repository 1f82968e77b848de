// ModelConfig and the tensor views on the fixture (geometry from tests/data/FIXTURES.md).
#include <gtest/gtest.h>

#include "moe/model.hpp"

namespace {

const std::string kData = MOE_TEST_DATA;

TEST(ModelConfig, FixtureGeometry) {
  auto m = moe::model::OwnedQuantizedModel::open(kData + "/tiny-qwen3moe-q4_k_m.gguf");
  const auto& c = m->config;
  EXPECT_EQ(c.arch, "qwen3moe");
  EXPECT_EQ(c.n_layer, 2u);
  EXPECT_EQ(c.n_embd, 256u);
  EXPECT_EQ(c.n_head, 4u);
  EXPECT_EQ(c.n_head_kv, 2u);
  EXPECT_EQ(c.head_dim, 64u);
  EXPECT_EQ(c.n_expert, 8u);
  EXPECT_EQ(c.n_expert_used, 2u);
  EXPECT_EQ(c.expert_ffn, 256u);
  EXPECT_EQ(c.context_length, 1024u);
  EXPECT_EQ(c.n_vocab, 4099u);
  EXPECT_FLOAT_EQ(c.rope_base, 1e6f);
  EXPECT_NEAR(c.rms_eps, 1e-6f, 1e-12f);
  EXPECT_FALSE(c.tied_output);
  ASSERT_EQ(m->layers.size(), 2u);
  EXPECT_EQ(m->layers[1].ffn_down_exps.type, moe::gguf::Type::Q6_K);
  // Expert e of a 3-D tensor starts e * ne1 * row_bytes(ne0) into it (REFERENCE §3.1).
  auto e3 = m->layers[0].ffn_gate_exps.expert(3);
  EXPECT_EQ(e3.data, m->layers[0].ffn_gate_exps.data + 3 * 256 * (256 / 256 * 144));
  EXPECT_EQ(e3.rows, 256);
  EXPECT_EQ(e3.cols, 256);
}

}  // namespace
