// ggml type ids and block geometry (REFERENCE.md §1.6).
#include <limits>

#include "moe/gguf.hpp"

namespace moe::gguf {
namespace {

struct Row {
  uint32_t id;
  TypeTraits traits;
};

constexpr Row kTypes[] = {
    {0, {"F32", 1, 4}},        {1, {"F16", 1, 2}},         {2, {"Q4_0", 32, 18}},
    {3, {"Q4_1", 32, 20}},     {6, {"Q5_0", 32, 22}},      {7, {"Q5_1", 32, 24}},
    {8, {"Q8_0", 32, 34}},     {9, {"Q8_1", 32, 36}},      {10, {"Q2_K", 256, 84}},
    {11, {"Q3_K", 256, 110}},  {12, {"Q4_K", 256, 144}},   {13, {"Q5_K", 256, 176}},
    {14, {"Q6_K", 256, 210}},  {15, {"Q8_K", 256, 292}},   {16, {"IQ2_XXS", 256, 66}},
    {17, {"IQ2_XS", 256, 74}}, {18, {"IQ3_XXS", 256, 98}}, {19, {"IQ1_S", 256, 50}},
    {20, {"IQ4_NL", 32, 18}},  {21, {"IQ3_S", 256, 110}},  {22, {"IQ2_S", 256, 82}},
    {23, {"IQ4_XS", 256, 136}}, {24, {"I8", 1, 1}},        {25, {"I16", 1, 2}},
    {26, {"I32", 1, 4}},       {27, {"I64", 1, 8}},        {28, {"F64", 1, 8}},
    {29, {"IQ1_M", 256, 56}},  {30, {"BF16", 1, 2}},       {34, {"TQ1_0", 256, 54}},
    {35, {"TQ2_0", 256, 66}},  {39, {"MXFP4", 32, 17}},    {40, {"NVFP4", 64, 36}},
    {41, {"Q1_0", 128, 18}},   {42, {"Q2_0", 64, 18}},
};

}  // namespace

TypeTraits type_traits(uint32_t type_id) {
  for (const Row& r : kTypes)
    if (r.id == type_id) return r.traits;
  return {nullptr, 0, 0};
}

std::string type_name(uint32_t type_id) {
  TypeTraits t = type_traits(type_id);
  return t.name ? std::string(t.name) : "type " + std::to_string(type_id);
}

size_t row_bytes(Type t, int64_t n) {
  TypeTraits tr = type_traits(t);
  if (tr.block_elems == 0 || n < 0 || n % tr.block_elems != 0)
    fail(Exit::unsupported, "a row of {} elements does not fit {} blocks", n, type_name(t));
  return static_cast<size_t>(n / tr.block_elems) * tr.block_bytes;
}

std::string_view value_type_name(ValueType t) {
  static constexpr std::string_view names[] = {"UINT8", "INT8",  "UINT16", "INT16", "UINT32",
                                               "INT32", "FLOAT32", "BOOL", "STRING", "ARRAY",
                                               "UINT64", "INT64", "FLOAT64"};
  auto i = static_cast<uint32_t>(t);
  return i < std::size(names) ? names[i] : std::string_view("UNKNOWN");
}

}  // namespace moe::gguf
