// GGUF parsing and validation. Every read is bounds-checked against the bytes that remain, and every
// count is checked against those bytes before anything is allocated (a header claiming 2^60 entries
// fails on the arithmetic, not on an allocation).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <unordered_map>

#include "moe/gguf.hpp"

namespace moe::gguf {

struct File::Index {
  std::unordered_map<std::string_view, size_t> keys;     // -> index in kvs_
  std::unordered_map<std::string_view, size_t> tensors;  // -> index in tensors_ (names owned by tensors_)
};

namespace {

constexpr uint64_t kMaxStringLength = uint64_t{1} << 30;  // as llama.cpp (GGUF_MAX_STRING_LENGTH)
constexpr uint64_t kMaxArrayCount = uint64_t{1} << 30;
constexpr uint32_t kMaxNameLength = 63;  // GGML_MAX_NAME - 1
constexpr int kMaxArrayDepth = 4;

// Smallest encoding of one element of each value type; used to refuse counts the remaining bytes
// cannot hold before reserving anything.
uint64_t min_encoded_size(ValueType t) {
  switch (t) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::BOOL: return 1;
    case ValueType::UINT16: case ValueType::INT16: return 2;
    case ValueType::UINT32: case ValueType::INT32: case ValueType::FLOAT32: return 4;
    case ValueType::UINT64: case ValueType::INT64: case ValueType::FLOAT64: return 8;
    case ValueType::STRING: return 8;
    case ValueType::ARRAY: return 12;
  }
  return 1;
}

bool is_numeric(ValueType t) {
  return t != ValueType::STRING && t != ValueType::ARRAY;
}

std::string describe_errno(int err) { return std::strerror(err); }

}  // namespace

// ---- Value --------------------------------------------------------------------------------------

int64_t Value::int_at(uint64_t idx) const {
  const uint8_t* p = raw + idx * min_encoded_size(elem_type);
  switch (elem_type) {
    case ValueType::UINT8: case ValueType::BOOL: return *p;
    case ValueType::INT8: return static_cast<int8_t>(*p);
    case ValueType::UINT16: { uint16_t v; std::memcpy(&v, p, 2); return v; }
    case ValueType::INT16: { int16_t v; std::memcpy(&v, p, 2); return v; }
    case ValueType::UINT32: { uint32_t v; std::memcpy(&v, p, 4); return v; }
    case ValueType::INT32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case ValueType::UINT64: { uint64_t v; std::memcpy(&v, p, 8); return static_cast<int64_t>(v); }
    case ValueType::INT64: { int64_t v; std::memcpy(&v, p, 8); return v; }
    case ValueType::FLOAT32: { float v; std::memcpy(&v, p, 4); return static_cast<int64_t>(v); }
    case ValueType::FLOAT64: { double v; std::memcpy(&v, p, 8); return static_cast<int64_t>(v); }
    default: return 0;
  }
}

double Value::float_at(uint64_t idx) const {
  const uint8_t* p = raw + idx * min_encoded_size(elem_type);
  if (elem_type == ValueType::FLOAT32) { float v; std::memcpy(&v, p, 4); return v; }
  if (elem_type == ValueType::FLOAT64) { double v; std::memcpy(&v, p, 8); return v; }
  return static_cast<double>(int_at(idx));
}

std::string Value::type_string() const {
  if (type != ValueType::ARRAY) return std::string(value_type_name(type));
  return "ARRAY[" + std::string(value_type_name(elem_type)) + "]";
}

std::string TensorInfo::shape_string() const {
  std::string s = "[";
  for (uint32_t d = 0; d < std::max<uint32_t>(n_dims, 1); ++d) {
    if (d) s += ", ";
    s += std::to_string(ne[d]);
  }
  return s + "]";
}

// ---- the reader ---------------------------------------------------------------------------------

namespace {

class Reader {
 public:
  Reader(const uint8_t* base, uint64_t size, const std::string& path) : base_(base), size_(size), path_(path) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }

  [[noreturn]] void corrupt(const std::string& what) const { corrupt_at(pos_, what); }
  [[noreturn]] void corrupt_at(uint64_t off, const std::string& what) const {
    fail(Exit::bad_file, "{}: {} (offset {})", path_, what, off);
  }

  void need(uint64_t n, const char* what) const {
    if (n > remaining())
      corrupt(fmt::format("truncated: {} needs {} bytes, {} remain", what, n, remaining()));
  }
  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  const uint8_t* take(uint64_t n, const char* what) {
    need(n, what);
    const uint8_t* p = base_ + pos_;
    pos_ += n;
    return p;
  }
  std::string_view read_string(const char* what) {
    uint64_t start = pos_;
    uint64_t len = read<uint64_t>(what);
    if (len > kMaxStringLength) corrupt_at(start, fmt::format("{} claims a length of {} bytes", what, len));
    if (len > remaining())
      corrupt_at(start, fmt::format("{} claims {} bytes but only {} remain", what, len, remaining()));
    const uint8_t* p = take(len, what);
    return {reinterpret_cast<const char*>(p), static_cast<size_t>(len)};
  }

 private:
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
  const std::string& path_;
};

void read_value(Reader& r, ValueType type, Value& out, const std::string& key, int depth);

void read_array(Reader& r, Value& out, const std::string& key, int depth) {
  uint64_t start = r.pos();
  uint32_t et = r.read<uint32_t>("array element type");
  if (et > static_cast<uint32_t>(ValueType::FLOAT64))
    r.corrupt_at(start, fmt::format("metadata '{}' is an array of unknown type id {}", key, et));
  out.elem_type = static_cast<ValueType>(et);
  out.count = r.read<uint64_t>("array count");
  if (out.count > kMaxArrayCount)
    r.corrupt_at(start, fmt::format("metadata '{}' claims {} array elements", key, out.count));
  // count * min size fits in 2^30 * 12, no overflow.
  if (out.count * min_encoded_size(out.elem_type) > r.remaining())
    r.corrupt_at(start, fmt::format("metadata '{}' claims {} array elements but only {} bytes remain", key,
                                    out.count, r.remaining()));
  if (is_numeric(out.elem_type)) {
    out.raw = r.take(out.count * min_encoded_size(out.elem_type), "array data");
    return;
  }
  if (out.elem_type == ValueType::STRING) {
    out.strings.reserve(out.count);
    for (uint64_t i = 0; i < out.count; ++i) out.strings.push_back(r.read_string("array string"));
    return;
  }
  if (depth >= kMaxArrayDepth)
    r.corrupt_at(start, fmt::format("metadata '{}' nests arrays deeper than {}", key, kMaxArrayDepth));
  out.items.resize(out.count);
  for (uint64_t i = 0; i < out.count; ++i) {
    out.items[i].type = ValueType::ARRAY;
    read_array(r, out.items[i], key, depth + 1);
  }
}

void read_value(Reader& r, ValueType type, Value& out, const std::string& key, int depth) {
  out.type = type;
  switch (type) {
    case ValueType::UINT8: out.u = r.read<uint8_t>("u8 value"); out.i = static_cast<int64_t>(out.u); break;
    case ValueType::INT8: out.i = r.read<int8_t>("i8 value"); break;
    case ValueType::UINT16: out.u = r.read<uint16_t>("u16 value"); out.i = static_cast<int64_t>(out.u); break;
    case ValueType::INT16: out.i = r.read<int16_t>("i16 value"); break;
    case ValueType::UINT32: out.u = r.read<uint32_t>("u32 value"); out.i = static_cast<int64_t>(out.u); break;
    case ValueType::INT32: out.i = r.read<int32_t>("i32 value"); break;
    case ValueType::UINT64: out.u = r.read<uint64_t>("u64 value"); out.i = static_cast<int64_t>(out.u); break;
    case ValueType::INT64: out.i = r.read<int64_t>("i64 value"); break;
    case ValueType::FLOAT32: out.f = r.read<float>("f32 value"); break;
    case ValueType::FLOAT64: out.f = r.read<double>("f64 value"); break;
    case ValueType::BOOL: out.u = r.read<uint8_t>("bool value") != 0; break;
    case ValueType::STRING: out.str = r.read_string("string value"); break;
    case ValueType::ARRAY: read_array(r, out, key, depth); break;
  }
  if (type == ValueType::INT8 || type == ValueType::INT16 || type == ValueType::INT32 || type == ValueType::INT64)
    out.u = static_cast<uint64_t>(out.i);
}

}  // namespace

// ---- File ---------------------------------------------------------------------------------------

File::~File() {
  if (map_) munmap(map_, size_);
}

std::shared_ptr<const File> File::open(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    fail(Exit::not_found, "cannot open model file '{}': {}", path, describe_errno(errno));
  if (S_ISDIR(st.st_mode)) fail(Exit::not_found, "model path '{}' is a directory, not a GGUF file", path);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(Exit::not_found, "cannot open model file '{}': {}", path, describe_errno(errno));
  struct stat fst {};
  if (::fstat(fd, &fst) != 0 || !S_ISREG(fst.st_mode)) {
    ::close(fd);
    fail(Exit::not_found, "model path '{}' is not a regular file", path);
  }
  std::shared_ptr<File> f(new File());
  f->path_ = path;
  f->size_ = static_cast<uint64_t>(fst.st_size);
  if (f->size_ == 0) {
    ::close(fd);
    fail(Exit::bad_file, "{}: not a GGUF file: the file is empty", path);
  }
  void* m = ::mmap(nullptr, f->size_, PROT_READ, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (m == MAP_FAILED) fail(Exit::not_found, "cannot map model file '{}': {}", path, describe_errno(err));
  f->map_ = m;
  f->base_ = static_cast<const uint8_t*>(m);
  f->parse_all();
  return f;
}

std::shared_ptr<const File> File::parse(std::span<const uint8_t> bytes, std::string name) {
  std::shared_ptr<File> f(new File());
  f->path_ = std::move(name);
  f->base_ = bytes.data();
  f->size_ = bytes.size();
  f->parse_all();
  return f;
}

void File::corrupt(uint64_t offset, const std::string& what) const {
  fail(Exit::bad_file, "{}: {} (offset {})", path_, what, offset);
}

void File::parse_all() {
  index_ = std::make_unique<Index>();
  Reader r(base_, size_, path_);
  if (size_ < 4 || std::memcmp(base_, "GGUF", 4) != 0)
    fail(Exit::bad_file, "{}: not a GGUF file (the first bytes are not the magic \"GGUF\")", path_);
  r.take(4, "magic");
  version_ = r.read<uint32_t>("version");
  if (version_ == 1) corrupt(4, "GGUF version 1 is not supported (version 2 and 3 are)");
  if (version_ == 0 || version_ > 3 || (version_ & 0xFFFF) == 0)
    corrupt(4, fmt::format("unsupported GGUF version {} (a byte-swapped file, or a newer format)", version_));
  uint64_t counts_at = r.pos();
  auto n_tensors = r.read<int64_t>("tensor count");
  auto n_kv = r.read<int64_t>("metadata count");
  if (n_tensors < 0 || n_kv < 0) corrupt(counts_at, "negative tensor or metadata count");
  // Minimal encodings: a key/value is >= 8+1+4+1 bytes, a tensor info >= 8+1+4+8+4+8.
  if (static_cast<uint64_t>(n_kv) > r.remaining() / 14)
    corrupt(counts_at + 8, fmt::format("the header claims {} metadata entries, more than the file can hold", n_kv));
  if (static_cast<uint64_t>(n_tensors) > r.remaining() / 33)
    corrupt(counts_at, fmt::format("the header claims {} tensors, more than the file can hold", n_tensors));

  kvs_.reserve(static_cast<size_t>(n_kv));
  for (int64_t k = 0; k < n_kv; ++k) {
    uint64_t at = r.pos();
    std::string_view key = r.read_string("metadata key");
    if (key.empty()) corrupt(at, fmt::format("metadata entry {} has an empty key", k));
    std::string key_s(key);
    if (index_->keys.count(key)) corrupt(at, fmt::format("duplicate metadata key '{}'", key_s));
    uint64_t type_at = r.pos();
    uint32_t type = r.read<uint32_t>("metadata value type");
    if (type > static_cast<uint32_t>(ValueType::FLOAT64))
      corrupt(type_at, fmt::format("metadata '{}' has unknown value type id {}", key_s, type));
    KeyValue kv;
    kv.key = key;
    read_value(r, static_cast<ValueType>(type), kv.value, key_s, 0);
    index_->keys.emplace(key, kvs_.size());
    kvs_.push_back(std::move(kv));
  }

  if (const Value* a = find("general.alignment")) {
    if (a->type != ValueType::UINT32)
      fail(Exit::bad_file, "{}: 'general.alignment' must be UINT32, found {}", path_, a->type_string());
    if (a->u == 0 || (a->u & (a->u - 1)) != 0)
      fail(Exit::bad_file, "{}: 'general.alignment' is {}, not a power of two", path_, a->u);
    alignment_ = static_cast<uint32_t>(a->u);
  }

  tensors_.resize(static_cast<size_t>(n_tensors));
  for (int64_t t = 0; t < n_tensors; ++t) {
    TensorInfo& ti = tensors_[static_cast<size_t>(t)];
    uint64_t at = r.pos();
    std::string_view name = r.read_string("tensor name");
    if (name.empty()) corrupt(at, fmt::format("tensor {} has an empty name", t));
    if (name.size() > kMaxNameLength)
      corrupt(at, fmt::format("tensor {} has a name of {} bytes (at most {})", t, name.size(), kMaxNameLength));
    ti.name.assign(name);
    uint64_t dims_at = r.pos();
    ti.n_dims = r.read<uint32_t>("tensor dimension count");
    if (ti.n_dims == 0 || ti.n_dims > 4)
      corrupt(dims_at, fmt::format("tensor '{}' has {} dimensions (1 to 4 allowed)", ti.name, ti.n_dims));
    for (uint32_t d = 0; d < ti.n_dims; ++d) {
      uint64_t ne_at = r.pos();
      int64_t ne = r.read<int64_t>("tensor dimension");
      if (ne <= 0) corrupt(ne_at, fmt::format("tensor '{}' has dimension {} = {}", ti.name, d, ne));
      ti.ne[d] = ne;
    }
    // Overflow-checked element count.
    int64_t n = 1;
    for (uint32_t d = 0; d < 4; ++d) {
      if (ti.ne[d] > std::numeric_limits<int64_t>::max() / n)
        corrupt(dims_at, fmt::format("tensor '{}' shape {} overflows the element count", ti.name, ti.shape_string()));
      n *= ti.ne[d];
    }
    uint64_t type_at = r.pos();
    uint32_t type = r.read<uint32_t>("tensor type");
    TypeTraits tr = type_traits(type);
    if (tr.block_elems == 0)
      corrupt(type_at, fmt::format("tensor '{}' has unknown type id {}", ti.name, type));
    ti.type = static_cast<Type>(type);
    if (ti.ne[0] % tr.block_elems != 0)
      corrupt(dims_at, fmt::format("tensor '{}' row of {} elements is not a multiple of the {} block size {}",
                                   ti.name, ti.ne[0], tr.name, tr.block_elems));
    uint64_t blocks = static_cast<uint64_t>(n) / tr.block_elems;
    if (blocks > std::numeric_limits<uint64_t>::max() / tr.block_bytes)
      corrupt(dims_at, fmt::format("tensor '{}' byte size overflows", ti.name));
    ti.nbytes = blocks * tr.block_bytes;
    uint64_t off_at = r.pos();
    ti.offset = r.read<uint64_t>("tensor offset");
    if (ti.offset % alignment_ != 0)
      corrupt(off_at, fmt::format("tensor '{}' offset {} is not a multiple of the alignment {}", ti.name, ti.offset,
                                  alignment_));
    if (!index_->tensors.emplace(std::string_view(ti.name), static_cast<size_t>(t)).second)
      corrupt(at, fmt::format("duplicate tensor name '{}'", ti.name));
  }
  // tensors_ was sized up front, so the string_views into names stay valid.

  uint64_t end_infos = r.pos();
  if (n_tensors > 0) {
    uint64_t a = alignment_;
    data_offset_ = (end_infos + a - 1) / a * a;
    if (data_offset_ > size_)
      corrupt(end_infos, fmt::format("the tensor data section starts at {} beyond the end of the file ({} bytes)",
                                     data_offset_, size_));
  } else {
    data_offset_ = end_infos;
  }
  uint64_t data_size = size_ - data_offset_;
  std::vector<size_t> order(tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) {
    TensorInfo& ti = tensors_[i];
    if (ti.offset > data_size || ti.nbytes > data_size - ti.offset)
      fail(Exit::bad_file,
           "{}: tensor '{}' data [{}, +{}) lies outside the file (data section of {} bytes at offset {})", path_,
           ti.name, ti.offset, ti.nbytes, data_size, data_offset_);
    ti.file_offset = data_offset_ + ti.offset;
    ti.data = base_ + ti.file_offset;
    order[i] = i;
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors_[a].offset < tensors_[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const TensorInfo& prev = tensors_[order[k - 1]];
    const TensorInfo& cur = tensors_[order[k]];
    if (prev.offset + prev.nbytes > cur.offset)
      fail(Exit::bad_file, "{}: tensors '{}' and '{}' overlap (offset {})", path_, prev.name, cur.name,
           data_offset_ + cur.offset);
  }
}

// ---- lookups ------------------------------------------------------------------------------------

const Value* File::find(std::string_view key) const {
  auto it = index_->keys.find(key);
  return it == index_->keys.end() ? nullptr : &kvs_[it->second].value;
}

const TensorInfo* File::tensor(std::string_view name) const {
  auto it = index_->tensors.find(name);
  return it == index_->tensors.end() ? nullptr : &tensors_[it->second];
}

namespace {

[[noreturn]] void missing(std::string_view key) {
  fail(Exit::unsupported, "'{}' is missing from the GGUF metadata", key);
}

const Value& typed(const File& f, std::string_view key, ValueType want) {
  const Value* v = f.find(key);
  if (!v) missing(key);
  if (v->type != want)
    fail(Exit::unsupported, "metadata '{}' should be {}, found {}", key, value_type_name(want), v->type_string());
  return *v;
}

}  // namespace

uint32_t File::get_u32(std::string_view key) const { return static_cast<uint32_t>(typed(*this, key, ValueType::UINT32).u); }
int32_t File::get_i32(std::string_view key) const { return static_cast<int32_t>(typed(*this, key, ValueType::INT32).i); }
uint64_t File::get_u64(std::string_view key) const { return typed(*this, key, ValueType::UINT64).u; }
float File::get_f32(std::string_view key) const { return static_cast<float>(typed(*this, key, ValueType::FLOAT32).f); }
bool File::get_bool(std::string_view key) const { return typed(*this, key, ValueType::BOOL).u != 0; }
std::string_view File::get_string(std::string_view key) const { return typed(*this, key, ValueType::STRING).str; }

const std::vector<std::string_view>& File::get_string_array(std::string_view key) const {
  const Value& v = typed(*this, key, ValueType::ARRAY);
  if (v.elem_type != ValueType::STRING)
    fail(Exit::unsupported, "metadata '{}' should be ARRAY[STRING], found {}", key, v.type_string());
  return v.strings;
}

const Value& File::get_array(std::string_view key, ValueType elem) const {
  const Value& v = typed(*this, key, ValueType::ARRAY);
  if (v.elem_type != elem)
    fail(Exit::unsupported, "metadata '{}' should be ARRAY[{}], found {}", key, value_type_name(elem), v.type_string());
  return v;
}

std::optional<uint32_t> File::opt_u32(std::string_view key) const {
  if (!has(key)) return std::nullopt;
  return get_u32(key);
}
std::optional<float> File::opt_f32(std::string_view key) const {
  if (!has(key)) return std::nullopt;
  return get_f32(key);
}
std::optional<bool> File::opt_bool(std::string_view key) const {
  if (!has(key)) return std::nullopt;
  return get_bool(key);
}
std::optional<std::string_view> File::opt_string(std::string_view key) const {
  if (!has(key)) return std::nullopt;
  return get_string(key);
}

}  // namespace moe::gguf
