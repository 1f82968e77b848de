// A small JSON reader for test fixtures (tests/data/golden/*.json): objects, arrays, strings with
// escapes, numbers, true/false/null. Not for untrusted input beyond the tests.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace json_lite {

struct Value {
  enum class Kind { null, boolean, number, string, array, object } kind = Kind::null;
  bool b = false;
  double num = 0.0;
  std::string str;
  std::vector<Value> arr;
  std::map<std::string, Value> obj;

  // Member access; throws std::runtime_error naming the key when absent or not an object.
  const Value& at(const std::string& key) const;
  bool has(const std::string& key) const { return kind == Kind::object && obj.count(key) != 0; }
  std::vector<double> numbers() const;  // an array of numbers
  std::vector<int32_t> ints() const;
};

Value parse(const std::string& text);    // throws std::runtime_error with the offset
Value load(const std::string& path);     // reads and parses a file

}  // namespace json_lite
