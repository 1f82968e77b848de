// A minimal JSON parser for checking moe-run's outputs in tests (written independently of the
// writer in src/run so the tests do not trust the code under test).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace mini_json {

struct Value {
  enum Kind { null, boolean, number, string, array, object } kind = null;
  bool b = false;
  double n = 0;
  std::string s;
  std::vector<Value> a;
  std::vector<std::pair<std::string, Value>> o;  // keeps order; duplicates are visible

  const Value& operator[](std::string_view k) const {
    for (const auto& [key, v] : o)
      if (key == k) return v;
    throw std::runtime_error("missing key " + std::string(k));
  }
  bool has(std::string_view k) const {
    for (const auto& kv : o)
      if (kv.first == k) return true;
    return false;
  }
  std::vector<std::string> keys() const {
    std::vector<std::string> k;
    for (const auto& kv : o) k.push_back(kv.first);
    return k;
  }
  std::vector<int64_t> ints() const {
    std::vector<int64_t> v;
    for (const auto& x : a) v.push_back(static_cast<int64_t>(x.n));
    return v;
  }
};

class Parser {
 public:
  explicit Parser(std::string_view t) : t_(t) {}
  Value parse_document() {
    Value v = value();
    ws();
    if (i_ != t_.size()) err("trailing text");
    return v;
  }

 private:
  [[noreturn]] void err(const char* what) {
    throw std::runtime_error(std::string("json: ") + what + " at offset " + std::to_string(i_));
  }
  void ws() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\n' || t_[i_] == '\t' || t_[i_] == '\r')) ++i_;
  }
  bool lit(std::string_view w) {
    if (t_.substr(i_, w.size()) == w) {
      i_ += w.size();
      return true;
    }
    return false;
  }
  static void put_utf8(std::string& o, uint32_t cp) {
    if (cp < 0x80) o += static_cast<char>(cp);
    else if (cp < 0x800) o += static_cast<char>(0xC0 | (cp >> 6)), o += static_cast<char>(0x80 | (cp & 0x3F));
    else if (cp < 0x10000)
      o += static_cast<char>(0xE0 | (cp >> 12)), o += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
          o += static_cast<char>(0x80 | (cp & 0x3F));
    else
      o += static_cast<char>(0xF0 | (cp >> 18)), o += static_cast<char>(0x80 | ((cp >> 12) & 0x3F)),
          o += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), o += static_cast<char>(0x80 | (cp & 0x3F));
  }
  uint32_t hex4() {
    if (i_ + 4 > t_.size()) err("short \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = t_[i_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<uint32_t>(c - 'A' + 10);
      else err("bad hex digit");
    }
    return v;
  }
  std::string str() {
    if (t_[i_] != '"') err("expected string");
    ++i_;
    std::string o;
    while (true) {
      if (i_ >= t_.size()) err("unterminated string");
      const char c = t_[i_++];
      if (c == '"') break;
      if (static_cast<unsigned char>(c) < 0x20) err("control character in string");
      if (c != '\\') {
        o += c;
        continue;
      }
      if (i_ >= t_.size()) err("bad escape");
      const char e = t_[i_++];
      switch (e) {
        case '"': o += '"'; break;
        case '\\': o += '\\'; break;
        case '/': o += '/'; break;
        case 'n': o += '\n'; break;
        case 't': o += '\t'; break;
        case 'r': o += '\r'; break;
        case 'b': o += '\b'; break;
        case 'f': o += '\f'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (!lit("\\u")) err("lone surrogate");
            const uint32_t lo = hex4();
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          put_utf8(o, cp);
          break;
        }
        default: err("bad escape");
      }
    }
    return o;
  }
  Value value() {
    ws();
    if (i_ >= t_.size()) err("unexpected end");
    Value v;
    const char c = t_[i_];
    if (c == '{') {
      v.kind = Value::object;
      ++i_;
      ws();
      if (t_[i_] == '}') {
        ++i_;
        return v;
      }
      while (true) {
        ws();
        std::string k = str();
        ws();
        if (t_[i_++] != ':') err("expected :");
        v.o.emplace_back(std::move(k), value());
        ws();
        if (t_[i_] == ',') {
          ++i_;
          continue;
        }
        if (t_[i_] == '}') {
          ++i_;
          return v;
        }
        err("expected , or }");
      }
    }
    if (c == '[') {
      v.kind = Value::array;
      ++i_;
      ws();
      if (t_[i_] == ']') {
        ++i_;
        return v;
      }
      while (true) {
        v.a.push_back(value());
        ws();
        if (t_[i_] == ',') {
          ++i_;
          continue;
        }
        if (t_[i_] == ']') {
          ++i_;
          return v;
        }
        err("expected , or ]");
      }
    }
    if (c == '"') {
      v.kind = Value::string;
      v.s = str();
      return v;
    }
    if (lit("true")) {
      v.kind = Value::boolean;
      v.b = true;
      return v;
    }
    if (lit("false")) {
      v.kind = Value::boolean;
      return v;
    }
    if (lit("null")) return v;
    const size_t start = i_;
    while (i_ < t_.size() && std::string_view("+-0123456789.eE").find(t_[i_]) != std::string_view::npos) ++i_;
    if (start == i_) err("unexpected character");
    v.kind = Value::number;
    v.n = std::stod(std::string(t_.substr(start, i_ - start)));
    return v;
  }

  std::string_view t_;
  size_t i_ = 0;
};

inline Value parse(std::string_view text) { return Parser(text).parse_document(); }

}  // namespace mini_json
