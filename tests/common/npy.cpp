#include "npy.hpp"

#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>

namespace npy {

namespace {

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw std::runtime_error(path + ": " + what);
}

// The value text of `key` in the header dict ("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }").
std::string dict_value(const std::string& header, const std::string& key, const std::string& path) {
  const std::string k = "'" + key + "'";
  size_t at = header.find(k);
  if (at == std::string::npos) bad(path, "npy header has no " + k);
  at = header.find(':', at + k.size());
  if (at == std::string::npos) bad(path, "npy header: no ':' after " + k);
  ++at;
  while (at < header.size() && header[at] == ' ') ++at;
  if (at >= header.size()) bad(path, "npy header truncated after " + k);
  if (header[at] == '\'') {
    const size_t end = header.find('\'', at + 1);
    if (end == std::string::npos) bad(path, "npy header: unterminated string for " + k);
    return header.substr(at + 1, end - at - 1);
  }
  if (header[at] == '(') {
    const size_t end = header.find(')', at);
    if (end == std::string::npos) bad(path, "npy header: unterminated tuple for " + k);
    return header.substr(at + 1, end - at - 1);
  }
  size_t end = at;
  while (end < header.size() && header[end] != ',' && header[end] != '}') ++end;
  return header.substr(at, end - at);
}

size_t item_size(const std::string& descr, const std::string& path) {
  if (descr == "<f4" || descr == "<i4" || descr == "<u4") return 4;
  if (descr == "<f8" || descr == "<i8" || descr == "<u8") return 8;
  bad(path, "unsupported npy dtype '" + descr + "'");
}

}  // namespace

int64_t Array::size() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<float> Array::as_f32() const {
  std::vector<float> out(static_cast<size_t>(size()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (descr == "<f4") {
      std::memcpy(&out[i], bytes.data() + 4 * i, 4);
    } else if (descr == "<f8") {
      double d;
      std::memcpy(&d, bytes.data() + 8 * i, 8);
      out[i] = static_cast<float>(d);
    } else {
      const std::vector<int64_t> v = as_i64();
      for (size_t j = 0; j < v.size(); ++j) out[j] = static_cast<float>(v[j]);
      return out;
    }
  }
  return out;
}

std::vector<int64_t> Array::as_i64() const {
  std::vector<int64_t> out(static_cast<size_t>(size()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (descr == "<i4") {
      int32_t v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      out[i] = v;
    } else if (descr == "<u4") {
      uint32_t v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      out[i] = v;
    } else if (descr == "<i8" || descr == "<u8") {
      std::memcpy(&out[i], bytes.data() + 8 * i, 8);
    } else if (descr == "<f4") {
      float v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      out[i] = static_cast<int64_t>(v);
    } else {
      double v;
      std::memcpy(&v, bytes.data() + 8 * i, 8);
      out[i] = static_cast<int64_t>(v);
    }
  }
  return out;
}

Array load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) bad(path, "cannot open");
  const std::vector<uint8_t> file((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (file.size() < 10 || std::memcmp(file.data(), "\x93NUMPY", 6) != 0) bad(path, "not an npy file");
  const int major = file[6];
  size_t header_len = 0, header_at = 0;
  if (major == 1) {
    header_len = file[8] | (file[9] << 8);
    header_at = 10;
  } else if (major == 2 || major == 3) {
    if (file.size() < 12) bad(path, "truncated npy header");
    header_len = file[8] | (file[9] << 8) | (file[10] << 16) | (static_cast<size_t>(file[11]) << 24);
    header_at = 12;
  } else {
    bad(path, "unsupported npy version " + std::to_string(major));
  }
  if (header_at + header_len > file.size()) bad(path, "truncated npy header");
  const std::string header(reinterpret_cast<const char*>(file.data() + header_at), header_len);

  Array a;
  a.descr = dict_value(header, "descr", path);
  if (dict_value(header, "fortran_order", path) != "False") bad(path, "Fortran-order arrays are not supported");
  const std::string shape = dict_value(header, "shape", path);
  size_t at = 0;
  while (at < shape.size()) {
    while (at < shape.size() && (shape[at] == ' ' || shape[at] == ',')) ++at;
    if (at >= shape.size()) break;
    size_t used = 0;
    a.shape.push_back(std::stoll(shape.substr(at), &used));
    at += used;
  }
  const size_t need = static_cast<size_t>(a.size()) * item_size(a.descr, path);
  const size_t data_at = header_at + header_len;
  if (file.size() - data_at < need)
    bad(path, "npy data truncated: need " + std::to_string(need) + " bytes, have " + std::to_string(file.size() - data_at));
  a.bytes.assign(file.begin() + static_cast<std::ptrdiff_t>(data_at),
                 file.begin() + static_cast<std::ptrdiff_t>(data_at + need));
  return a;
}

}  // namespace npy
