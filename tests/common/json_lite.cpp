#include "json_lite.hpp"

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace json_lite {

namespace {

struct Parser {
  const std::string& s;
  size_t i = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("json: " + what + " at offset " + std::to_string(i));
  }
  void ws() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) ++i;
  }
  bool lit(const char* w) {
    size_t n = 0;
    while (w[n]) ++n;
    if (s.compare(i, n, w) == 0) {
      i += n;
      return true;
    }
    return false;
  }
  static void put_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  uint32_t hex4() {
    if (i + 4 > s.size()) fail("truncated \\u escape");
    const uint32_t v = static_cast<uint32_t>(std::stoul(s.substr(i, 4), nullptr, 16));
    i += 4;
    return v;
  }
  std::string string() {
    if (s[i] != '"') fail("expected a string");
    ++i;
    std::string out;
    while (true) {
      if (i >= s.size()) fail("unterminated string");
      const char ch = s[i++];
      if (ch == '"') break;
      if (ch != '\\') {
        out += ch;
        continue;
      }
      if (i >= s.size()) fail("unterminated escape");
      const char e = s[i++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && s.compare(i, 2, "\\u") == 0) {
            i += 2;
            const uint32_t lo = hex4();
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          put_utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
    return out;
  }
  Value value() {
    ws();
    if (i >= s.size()) fail("unexpected end");
    Value v;
    const char ch = s[i];
    if (ch == '{') {
      v.kind = Value::Kind::object;
      ++i;
      ws();
      if (s[i] == '}') {
        ++i;
        return v;
      }
      while (true) {
        ws();
        std::string key = string();
        ws();
        if (i >= s.size() || s[i] != ':') fail("expected ':'");
        ++i;
        v.obj[key] = value();
        ws();
        if (i < s.size() && s[i] == ',') {
          ++i;
          continue;
        }
        if (i < s.size() && s[i] == '}') {
          ++i;
          return v;
        }
        fail("expected ',' or '}'");
      }
    }
    if (ch == '[') {
      v.kind = Value::Kind::array;
      ++i;
      ws();
      if (s[i] == ']') {
        ++i;
        return v;
      }
      while (true) {
        v.arr.push_back(value());
        ws();
        if (i < s.size() && s[i] == ',') {
          ++i;
          continue;
        }
        if (i < s.size() && s[i] == ']') {
          ++i;
          return v;
        }
        fail("expected ',' or ']'");
      }
    }
    if (ch == '"') {
      v.kind = Value::Kind::string;
      v.str = string();
      return v;
    }
    if (lit("true")) {
      v.kind = Value::Kind::boolean;
      v.b = true;
      return v;
    }
    if (lit("false")) {
      v.kind = Value::Kind::boolean;
      return v;
    }
    if (lit("null")) return v;
    const char* begin = s.c_str() + i;
    char* end = nullptr;
    v.num = std::strtod(begin, &end);
    if (end == begin) fail("bad value");
    i += static_cast<size_t>(end - begin);
    v.kind = Value::Kind::number;
    return v;
  }
};

}  // namespace

const Value& Value::at(const std::string& key) const {
  if (kind != Kind::object) throw std::runtime_error("json: not an object when looking up '" + key + "'");
  auto it = obj.find(key);
  if (it == obj.end()) throw std::runtime_error("json: missing key '" + key + "'");
  return it->second;
}

std::vector<double> Value::numbers() const {
  if (kind != Kind::array) throw std::runtime_error("json: not an array");
  std::vector<double> out;
  for (const Value& v : arr) {
    if (v.kind != Kind::number) throw std::runtime_error("json: array element is not a number");
    out.push_back(v.num);
  }
  return out;
}

std::vector<int32_t> Value::ints() const {
  std::vector<int32_t> out;
  for (double d : numbers()) out.push_back(static_cast<int32_t>(d));
  return out;
}

Value parse(const std::string& text) {
  Parser p{text};
  Value v = p.value();
  p.ws();
  if (p.i != text.size()) p.fail("trailing characters");
  return v;
}

Value load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return parse(ss.str());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
}

}  // namespace json_lite
