// An independent double-precision decoder of the block formats, written for the tests straight from
// the byte layouts of REFERENCE.md §5 (byte offsets, no shared structs or helpers with src/quant).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe::quant::test {

double half_to_double(uint16_t h);
// Decodes n elements of ggml type id `type` starting at `p`. Returns false for a type it cannot decode.
bool ref_decode(uint32_t type, const uint8_t* p, int64_t n, std::vector<double>& out);
// Bytes per block and elements per block of the types above.
int ref_block_elems(uint32_t type);
int ref_block_bytes(uint32_t type);

}  // namespace moe::quant::test
