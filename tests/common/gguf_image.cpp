#include "gguf_image.hpp"

#include <fstream>
#include <iterator>
#include <stdexcept>

namespace gguf_test {
namespace {

struct Walker {
  const std::vector<uint8_t>& b;
  uint64_t pos = 0;
  std::vector<Field>* fields;

  template <typename T>
  T get(const char* what) {
    if (pos + sizeof(T) > b.size()) throw std::runtime_error("test walker: truncated");
    fields->push_back({pos, what});
    T v;
    std::memcpy(&v, b.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string str(const char* what) {
    uint64_t n = get<uint64_t>(what);
    std::string s(reinterpret_cast<const char*>(b.data() + pos), n);
    pos += n;
    return s;
  }
};

uint64_t scalar_size(uint32_t t) {
  switch (t) {
    case 0: case 1: case 7: return 1;
    case 2: case 3: return 2;
    case 4: case 5: case 6: return 4;
    case 10: case 11: case 12: return 8;
  }
  return 0;
}

// Skips one value, recording fields for small values only (big arrays are recorded at their start).
void skip_value(Walker& w, uint32_t type) {
  if (type == 8) {
    w.str("string");
  } else if (type == 9) {
    uint32_t et = w.get<uint32_t>("array type");
    uint64_t n = w.get<uint64_t>("array count");
    for (uint64_t i = 0; i < n; ++i) {
      if (et == 8) {
        uint64_t len;
        std::memcpy(&len, w.b.data() + w.pos, 8);
        if (i < 4 || i + 1 == n) w.fields->push_back({w.pos, "array string"});
        w.pos += 8 + len;
      } else if (et == 9) {
        skip_value(w, 9);
      } else {
        if (i < 4 || i + 1 == n) w.fields->push_back({w.pos, "array element"});
        w.pos += scalar_size(et);
      }
    }
  } else {
    w.fields->push_back({w.pos, "scalar"});
    w.pos += scalar_size(type);
  }
}

}  // namespace

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

Image Image::read(const std::vector<uint8_t>& bytes) {
  Image img;
  Walker w{bytes, 0, &img.fields};
  w.get<uint32_t>("magic");
  img.version = w.get<uint32_t>("version");
  uint64_t nt = w.get<uint64_t>("tensor count");
  uint64_t nk = w.get<uint64_t>("kv count");
  for (uint64_t k = 0; k < nk; ++k) {
    Kv kv;
    kv.key = w.str("key");
    kv.type = w.get<uint32_t>("value type");
    uint64_t start = w.pos;
    skip_value(w, kv.type);
    kv.value.assign(bytes.begin() + static_cast<long>(start), bytes.begin() + static_cast<long>(w.pos));
    if (kv.key == "general.alignment") std::memcpy(&img.alignment, kv.value.data(), 4);
    img.kvs.push_back(std::move(kv));
  }
  for (uint64_t t = 0; t < nt; ++t) {
    TensorRec r;
    r.name = w.str("tensor name");
    uint32_t nd = w.get<uint32_t>("n_dims");
    for (uint32_t d = 0; d < nd; ++d) r.ne.push_back(w.get<int64_t>("ne"));
    r.type = w.get<uint32_t>("tensor type");
    r.offset = w.get<uint64_t>("tensor offset");
    img.tensors.push_back(std::move(r));
  }
  // The data section is aligned only when there are tensors (a vocab-only file ends right here).
  uint64_t data_start = nt ? (w.pos + img.alignment - 1) / img.alignment * img.alignment : w.pos;
  img.fields.push_back({data_start, "data"});
  img.data.assign(bytes.begin() + static_cast<long>(data_start), bytes.end());
  return img;
}

std::vector<uint8_t> Image::write() const {
  std::vector<uint8_t> out;
  out.insert(out.end(), {'G', 'G', 'U', 'F'});
  put<uint32_t>(out, version);
  put<uint64_t>(out, tensors.size());
  put<uint64_t>(out, kvs.size());
  for (const Kv& kv : kvs) {
    put<uint64_t>(out, kv.key.size());
    out.insert(out.end(), kv.key.begin(), kv.key.end());
    put<uint32_t>(out, kv.type);
    out.insert(out.end(), kv.value.begin(), kv.value.end());
  }
  for (const TensorRec& r : tensors) {
    put<uint64_t>(out, r.name.size());
    out.insert(out.end(), r.name.begin(), r.name.end());
    put<uint32_t>(out, static_cast<uint32_t>(r.ne.size()));
    for (int64_t v : r.ne) put<int64_t>(out, v);
    put<uint32_t>(out, r.type);
    put<uint64_t>(out, r.offset);
  }
  if (!tensors.empty())
    while (out.size() % alignment) out.push_back(0);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

Kv* Image::find(const std::string& key) {
  for (Kv& kv : kvs)
    if (kv.key == key) return &kv;
  return nullptr;
}

TensorRec* Image::tensor(const std::string& name) {
  for (TensorRec& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

void Image::set_u32(const std::string& key, uint32_t v) {
  Kv* kv = find(key);
  if (!kv) {
    kvs.push_back({key, 4, {}});
    kv = &kvs.back();
  }
  kv->type = 4;
  kv->value.clear();
  put<uint32_t>(kv->value, v);
}

void Image::set_i32(const std::string& key, int32_t v) {
  Kv* kv = find(key);
  kv->type = 5;
  kv->value.clear();
  put<int32_t>(kv->value, v);
}

void Image::erase(const std::string& key) {
  for (size_t i = 0; i < kvs.size(); ++i)
    if (kvs[i].key == key) {
      kvs.erase(kvs.begin() + static_cast<long>(i));
      return;
    }
}

}  // namespace gguf_test
