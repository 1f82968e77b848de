// libFuzzer target: GGUF parsing plus qwen3moe model validation on arbitrary bytes.
// Any moe::Error is an expected rejection; anything else (a crash, a sanitizer report, another
// exception) is a finding.
#include <cstddef>
#include <cstdint>
#include <span>

#include "moe/gguf.hpp"
#include "moe/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto f = moe::gguf::File::parse(std::span<const uint8_t>(data, size), "fuzz.gguf");
    // Touch what a run touches: metadata accessors and every tensor's bytes.
    for (const auto& kv : f->metadata()) (void)kv.value.type_string();
    volatile uint8_t sink = 0;
    for (const auto& t : f->tensors())
      if (t.nbytes) sink = sink ^ t.data[0] ^ t.data[t.nbytes - 1];
    moe::model::OwnedQuantizedModel::load(f);
  } catch (const moe::Error&) {
  }
  return 0;
}
