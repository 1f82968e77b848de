// A GGUF image the tests can take apart and rebuild: an independent walker over a valid file that
// records every field's offset, plus a writer. Written separately from src/gguf so the tests do not
// check the parser against itself.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace gguf_test {

struct Field {
  uint64_t offset;  // where the field starts
  std::string what;
};

struct Kv {
  std::string key;
  uint32_t type;
  std::vector<uint8_t> value;  // encoded value bytes (after the type id)
};

struct TensorRec {
  std::string name;
  std::vector<int64_t> ne;
  uint32_t type;
  uint64_t offset;
};

struct Image {
  uint32_t version = 3;
  std::vector<Kv> kvs;
  std::vector<TensorRec> tensors;
  std::vector<uint8_t> data;  // the data section
  uint32_t alignment = 32;
  std::vector<Field> fields;  // filled by read()

  static Image read(const std::vector<uint8_t>& bytes);
  std::vector<uint8_t> write() const;

  Kv* find(const std::string& key);
  TensorRec* tensor(const std::string& name);
  void set_u32(const std::string& key, uint32_t v);
  void set_i32(const std::string& key, int32_t v);
  void erase(const std::string& key);
};

std::vector<uint8_t> read_file(const std::string& path);

template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  uint8_t b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.insert(out.end(), b, b + sizeof(T));
}
template <typename T>
void poke(std::vector<uint8_t>& out, uint64_t at, T v) {
  std::memcpy(out.data() + at, &v, sizeof(T));
}

}  // namespace gguf_test
