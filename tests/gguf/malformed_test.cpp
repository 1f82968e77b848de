// Malformed files generated from a valid fixture. Each must give moe::Error with the documented
// category (4 = corrupt file), a message naming the field, key or tensor,
// no signal, and no allocation beyond the file's size.
#include <gtest/gtest.h>

#include "malformed.hpp"
#include "moe/gguf.hpp"

namespace {

using gguf_test::Image;
using moe::Exit;

using gguf_test::Outcome;

const std::vector<uint8_t>& fixture() { return gguf_test::q8_fixture(); }

// Parses the bytes.
Outcome load(const std::vector<uint8_t>& bytes) {
  return gguf_test::attempt([&] { moe::gguf::File::parse(bytes, "bad.gguf"); });
}

void expect_error(const std::vector<uint8_t>& bytes, Exit code, const std::string& needle) {
  gguf_test::expect_rejected(load(bytes), bytes.size(), code, needle);
}

TEST(GgufMalformed, TheUnmodifiedFixtureLoads) {
  Outcome o = load(fixture());
  EXPECT_FALSE(o.threw) << o.message;
  Image img = Image::read(fixture());
  EXPECT_EQ(img.write(), fixture()) << "the test's writer must reproduce the file byte for byte";
}

TEST(GgufMalformed, TruncationAtEveryFieldBoundary) {
  Image img = Image::read(fixture());
  size_t checked = 0;
  for (const auto& field : img.fields) {
    for (uint64_t cut : {field.offset, field.offset + 1}) {
      if (cut >= fixture().size()) continue;
      std::vector<uint8_t> b(fixture().begin(), fixture().begin() + static_cast<long>(cut));
      Outcome o = load(b);
      ASSERT_TRUE(o.threw) << "truncated at " << cut << " (" << field.what << ") was accepted";
      EXPECT_EQ(static_cast<int>(o.code), static_cast<int>(Exit::bad_file)) << cut << ": " << o.message;
      EXPECT_LE(o.largest_alloc, 2 * b.size() + 4096);
      ++checked;
    }
  }
  EXPECT_GT(checked, 200u);
  // Cutting inside the data section: a tensor now lies outside the file.
  std::vector<uint8_t> b(fixture().begin(), fixture().end() - 100);
  expect_error(b, Exit::bad_file, "outside the file");
}

TEST(GgufMalformed, BadMagicAndVersions) {
  auto b = fixture();
  b[0] = 'X';
  expect_error(b, Exit::bad_file, "not a GGUF file");
  b = fixture();
  gguf_test::poke<uint32_t>(b, 4, 1);
  expect_error(b, Exit::bad_file, "version 1");
  gguf_test::poke<uint32_t>(b, 4, 4);
  expect_error(b, Exit::bad_file, "unsupported GGUF version 4");
  gguf_test::poke<uint32_t>(b, 4, 0x03000000);  // byte-swapped 3
  expect_error(b, Exit::bad_file, "unsupported GGUF version");
  expect_error(std::vector<uint8_t>{'G', 'G'}, Exit::bad_file, "not a GGUF file");
}

TEST(GgufMalformed, VersionTwoIsAccepted) {
  auto b = fixture();
  gguf_test::poke<uint32_t>(b, 4, 2);
  Outcome o = load(b);
  EXPECT_FALSE(o.threw) << o.message;
}

TEST(GgufMalformed, HugeCountsAndLengthsAllocateNothing) {
  auto b = fixture();
  gguf_test::poke<uint64_t>(b, 16, uint64_t{1} << 60);  // kv count
  expect_error(b, Exit::bad_file, "metadata entries");
  b = fixture();
  gguf_test::poke<uint64_t>(b, 8, uint64_t{1} << 60);  // tensor count
  expect_error(b, Exit::bad_file, "tensors");
  b = fixture();
  gguf_test::poke<uint64_t>(b, 8, ~uint64_t{0});  // negative as i64
  expect_error(b, Exit::bad_file, "negative");
  b = fixture();
  gguf_test::poke<uint64_t>(b, 24, uint64_t{1} << 40);  // first key length
  expect_error(b, Exit::bad_file, "metadata key");

  Image img = Image::read(fixture());
  // A string array claiming 2^29 elements (under the 2^30 cap, far over the file).
  auto* tokens = img.find("tokenizer.ggml.tokens");
  gguf_test::poke<uint64_t>(tokens->value, 4, uint64_t{1} << 29);
  expect_error(img.write(), Exit::bad_file, "tokenizer.ggml.tokens");
  gguf_test::poke<uint64_t>(tokens->value, 4, uint64_t{1} << 62);
  expect_error(img.write(), Exit::bad_file, "tokenizer.ggml.tokens");
}

TEST(GgufMalformed, UnknownTypeIds) {
  Image img = Image::read(fixture());
  img.kvs[1].type = 13;
  expect_error(img.write(), Exit::bad_file, "unknown value type id 13");
  img = Image::read(fixture());
  img.tensors[0].type = 4;  // removed Q4_2
  expect_error(img.write(), Exit::bad_file, "unknown type id 4");
  img.tensors[0].type = 1000;
  expect_error(img.write(), Exit::bad_file, "unknown type id 1000");
  img = Image::read(fixture());
  img.find("tokenizer.ggml.token_type")->value[0] = 77;  // array element type
  expect_error(img.write(), Exit::bad_file, "unknown type id 77");
}

TEST(GgufMalformed, OffsetsAndShapes) {
  Image img = Image::read(fixture());
  img.tensors[3].offset += 1;
  expect_error(img.write(), Exit::bad_file, "not a multiple of the alignment");
  img = Image::read(fixture());
  img.tensors[3].offset = uint64_t{1} << 50;
  expect_error(img.write(), Exit::bad_file, "outside the file");
  img = Image::read(fixture());
  img.tensors[3].offset = ~uint64_t{0} - 31;  // aligned, overflows offset + nbytes
  expect_error(img.write(), Exit::bad_file, "outside the file");
  img = Image::read(fixture());
  img.tensors[4].offset = img.tensors[3].offset;
  expect_error(img.write(), Exit::bad_file, "overlap");
  img = Image::read(fixture());
  img.tensors[2].ne = {256, int64_t{1} << 40, int64_t{1} << 40};
  expect_error(img.write(), Exit::bad_file, "overflows");
  img = Image::read(fixture());
  img.tensors[2].ne = {256, 1, 1, 1, 1};
  expect_error(img.write(), Exit::bad_file, "5 dimensions");
  img = Image::read(fixture());
  img.tensors[2].ne = {256, -4};
  expect_error(img.write(), Exit::bad_file, "dimension 1 = -4");
  img = Image::read(fixture());
  img.tensors[2].ne[0] = 250;  // not a multiple of the Q8_0 block
  img.tensors[2].type = 8;
  expect_error(img.write(), Exit::bad_file, "block size");
}

TEST(GgufMalformed, DuplicatesAndNames) {
  Image img = Image::read(fixture());
  img.tensors[5].name = img.tensors[4].name;
  expect_error(img.write(), Exit::bad_file, "duplicate tensor name");
  img = Image::read(fixture());
  img.kvs[3].key = img.kvs[2].key;
  expect_error(img.write(), Exit::bad_file, "duplicate metadata key");
  img = Image::read(fixture());
  img.tensors[1].name = std::string(64, 'x');
  expect_error(img.write(), Exit::bad_file, "64 bytes");
  img = Image::read(fixture());
  img.kvs[0].key.clear();
  expect_error(img.write(), Exit::bad_file, "empty key");
}

TEST(GgufMalformed, Alignment) {
  Image img = Image::read(fixture());
  img.set_u32("general.alignment", 48);
  expect_error(img.write(), Exit::bad_file, "power of two");
}

}  // namespace
