// GGUF v2/v3 reader: read-only mmap, every metadata type, the tensor table, strict validation.
// The file is untrusted input: every count and length is checked against the bytes that remain
// before anything is allocated; tensor data is never copied (TensorInfo::data points into the map).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe/error.hpp"

namespace moe::gguf {

// ---- ggml tensor types (REFERENCE.md §1.6) ------------------------------------
enum class Type : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
  IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39, NVFP4 = 40, Q1_0 = 41, Q2_0 = 42,
};
inline constexpr uint32_t kTypeCount = 43;

struct TypeTraits {
  const char* name;      // "Q4_K"; nullptr for removed ids
  uint32_t block_elems;  // elements per block (0 = removed id)
  uint32_t block_bytes;  // bytes per block
};
// Traits of a type id; block_elems == 0 for ids that are unknown or removed.
TypeTraits type_traits(uint32_t type_id);
inline TypeTraits type_traits(Type t) { return type_traits(static_cast<uint32_t>(t)); }
std::string type_name(uint32_t type_id);  // "Q4_K", or "type 99" when unknown
inline std::string type_name(Type t) { return type_name(static_cast<uint32_t>(t)); }
// Bytes of one row of `n` elements (n must be a multiple of the block size).
size_t row_bytes(Type t, int64_t n);

// ---- metadata values --------------------------------------------------------------
enum class ValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};
std::string_view value_type_name(ValueType t);  // "UINT32", "ARRAY[STRING]" is built by callers

struct Value {
  ValueType type = ValueType::UINT8;
  // Scalars: integers in i (signed types) or u (unsigned/bool), floats in f.
  uint64_t u = 0;
  int64_t i = 0;
  double f = 0.0;
  std::string_view str;  // STRING: points into the mapping (not NUL-terminated)
  // ARRAY: element type and count. Numeric elements stay in the file (raw, little-endian);
  // strings are indexed once; nested arrays are parsed into `items`.
  ValueType elem_type = ValueType::UINT8;
  uint64_t count = 0;
  const uint8_t* raw = nullptr;            // numeric array elements
  std::vector<std::string_view> strings;   // string array elements
  std::vector<Value> items;                // nested array elements

  // Element i of a numeric array, converted (no range check beyond count).
  int64_t int_at(uint64_t idx) const;
  double float_at(uint64_t idx) const;
  std::string type_string() const;  // "UINT32", "ARRAY[INT32]", ...
};

struct KeyValue {
  std::string_view key;
  Value value;
};

// ---- tensors ---------------------------------------------------------------------------
struct TensorInfo {
  std::string name;
  uint32_t n_dims = 0;
  std::array<int64_t, 4> ne{1, 1, 1, 1};  // ggml order: ne[0] innermost
  Type type = Type::F32;
  uint64_t offset = 0;   // relative to the data section
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;  // into the mapping
  uint64_t file_offset = 0;       // absolute offset of the data in the file

  int64_t nelements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  size_t row_bytes() const { return nbytes / static_cast<uint64_t>(ne[1] * ne[2] * ne[3]); }
  std::string shape_string() const;  // "[2048, 768, 128]" (n_dims entries)
};

// ---- the file ----------------------------------------------------------------------------
class File {
 public:
  // Maps and parses `path`. Throws Error: Exit::not_found (missing, unreadable, a directory),
  // Exit::bad_file (not GGUF, corrupt, truncated; the message names the field and offset).
  static std::shared_ptr<const File> open(const std::string& path);
  // Parses an in-memory image (tests, fuzzing). The bytes must outlive the File.
  static std::shared_ptr<const File> parse(std::span<const uint8_t> bytes, std::string name = "<memory>");

  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t file_size() const { return size_; }
  uint32_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  const uint8_t* bytes() const { return base_; }

  // ---- metadata
  const std::vector<KeyValue>& metadata() const { return kvs_; }
  const Value* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }
  // Strict typed accessors (REFERENCE.md §1.7: no conversions). A missing key throws
  // Exit::unsupported "'KEY' is missing from the GGUF metadata"; a wrong type names the key,
  // the expected and the found type.
  uint32_t get_u32(std::string_view key) const;
  int32_t get_i32(std::string_view key) const;
  uint64_t get_u64(std::string_view key) const;
  float get_f32(std::string_view key) const;
  bool get_bool(std::string_view key) const;
  std::string_view get_string(std::string_view key) const;
  const std::vector<std::string_view>& get_string_array(std::string_view key) const;
  // An array with numeric (integer) elements of any integer type; elem types checked.
  const Value& get_array(std::string_view key, ValueType elem) const;
  std::optional<uint32_t> opt_u32(std::string_view key) const;
  std::optional<float> opt_f32(std::string_view key) const;
  std::optional<bool> opt_bool(std::string_view key) const;
  std::optional<std::string_view> opt_string(std::string_view key) const;

  // ---- tensors
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* tensor(std::string_view name) const;  // nullptr if absent

 private:
  File() = default;
  void parse_all();
  [[noreturn]] void corrupt(uint64_t offset, const std::string& what) const;

  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  void* map_ = nullptr;  // munmap on destruction (nullptr for parse())
  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<KeyValue> kvs_;
  std::vector<TensorInfo> tensors_;
  struct Index;
  std::unique_ptr<Index> index_;
};

}  // namespace moe::gguf
