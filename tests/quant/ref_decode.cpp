#include "ref_decode.hpp"

#include <cmath>
#include <cstring>

namespace moe::quant::test {
namespace {
uint16_t u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
double h(const uint8_t* p) { return half_to_double(u16(p)); }
}  // namespace

double half_to_double(uint16_t v) {
  int sign = (v >> 15) ? -1 : 1;
  int e = (v >> 10) & 31;
  int m = v & 1023;
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), -24);
  if (e == 31) return m ? NAN : sign * INFINITY;
  return sign * std::ldexp(1024.0 + m, e - 25);
}

int ref_block_elems(uint32_t t) {
  switch (t) {
    case 0: case 1: case 30: return 1;
    case 2: case 3: case 6: case 7: case 8: case 9: return 32;
    case 10: case 11: case 12: case 13: case 14: case 15: return 256;
    default: return 0;
  }
}
int ref_block_bytes(uint32_t t) {
  switch (t) {
    case 0: return 4; case 1: return 2; case 30: return 2;
    case 2: return 18; case 3: return 20; case 6: return 22; case 7: return 24; case 8: return 34; case 9: return 36;
    case 10: return 84; case 11: return 110; case 12: return 144; case 13: return 176; case 14: return 210;
    case 15: return 292;
    default: return 0;
  }
}

// Element e of one block.
static double element(uint32_t t, const uint8_t* b, int e) {
  switch (t) {
    case 2: {  // Q4_0: d | qs[16]; byte j: low nibble = element j, high = j+16
      int q = e < 16 ? (b[2 + e] & 15) : (b[2 + e - 16] >> 4);
      return h(b) * (q - 8);
    }
    case 3: {  // Q4_1: d | m | qs
      int q = e < 16 ? (b[4 + e] & 15) : (b[4 + e - 16] >> 4);
      return h(b) * q + h(b + 2);
    }
    case 6: case 7: {  // Q5_0: d | qh[4] | qs ; Q5_1: d | m | qh | qs
      int off = t == 6 ? 2 : 4;
      uint32_t qh = b[off] | (b[off + 1] << 8) | (b[off + 2] << 16) | (static_cast<uint32_t>(b[off + 3]) << 24);
      int q = e < 16 ? (b[off + 4 + e] & 15) : (b[off + 4 + e - 16] >> 4);
      q |= static_cast<int>((qh >> e) & 1) << 4;
      return t == 6 ? h(b) * (q - 16) : h(b) * q + h(b + 2);
    }
    case 8: return h(b) * static_cast<int8_t>(b[2 + e]);
    case 9: return h(b) * static_cast<int8_t>(b[4 + e]);
    case 10: {  // Q2_K: scales[16] @0, qs[64] @16, d @80, dmin @82
      int n = e / 128, j = (e % 128) / 32, l = e % 32;
      int q = (b[16 + 32 * n + l] >> (2 * j)) & 3;
      int sc = b[e / 16];
      return h(b + 80) * (sc & 15) * q - h(b + 82) * (sc >> 4);
    }
    case 11: {  // Q3_K: hmask[32] @0, qs[64] @32, scales[12] @96, d @108
      int n = e / 128, j = (e % 128) / 32, l = e % 32;
      int low = (b[32 + 32 * n + l] >> (2 * j)) & 3;
      int hb = (b[l] >> (4 * n + j)) & 1;
      int i = e / 16;
      const uint8_t* s = b + 96;
      int lo4 = i < 8 ? (s[i] & 15) : (s[i - 8] >> 4);
      int hi2 = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
      int sc = (lo4 | (hi2 << 4)) - 32;
      return h(b + 108) * sc * (low - (hb ? 0 : 4));
    }
    case 12: case 13: {  // Q4_K: d, dmin, scales[12] @4, qs[128] @16 ; Q5_K: ..., qh[32] @16, qs @48
      int sub = e / 32, c = e / 64, l = e % 32;
      const uint8_t* s = b + 4;
      int sc, m;
      if (sub < 4) { sc = s[sub] & 63; m = s[sub + 4] & 63; }
      else { sc = (s[sub + 4] & 15) | ((s[sub - 4] >> 6) << 4); m = (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4); }
      int qs_off = t == 12 ? 16 : 48;
      int byte = b[qs_off + 32 * c + l];
      int q = (sub % 2 == 0) ? (byte & 15) : (byte >> 4);
      if (t == 13) q += ((b[16 + l] >> sub) & 1) << 4;
      return h(b) * sc * q - h(b + 2) * m;
    }
    case 14: {  // Q6_K: ql[128] @0, qh[64] @128, scales[16] @192, d @208
      int n = e / 128, r = e % 128, k = r / 32, l = r % 32;
      int lbyte = b[64 * n + l + (k % 2) * 32];
      int low = k < 2 ? (lbyte & 15) : (lbyte >> 4);
      int hi = (b[128 + 32 * n + l] >> (2 * k)) & 3;
      int sc = static_cast<int8_t>(b[192 + e / 16]);
      return h(b + 208) * sc * ((low | (hi << 4)) - 32);
    }
    case 15: {  // Q8_K: f32 d, qs[256], bsums
      float d;
      std::memcpy(&d, b, 4);
      return static_cast<double>(d) * static_cast<int8_t>(b[4 + e]);
    }
    default: return NAN;
  }
}

bool ref_decode(uint32_t t, const uint8_t* p, int64_t n, std::vector<double>& out) {
  out.assign(static_cast<size_t>(n), 0.0);
  if (t == 0) {
    for (int64_t i = 0; i < n; ++i) { float f; std::memcpy(&f, p + 4 * i, 4); out[i] = f; }
    return true;
  }
  if (t == 1) {
    for (int64_t i = 0; i < n; ++i) out[i] = half_to_double(u16(p + 2 * i));
    return true;
  }
  if (t == 30) {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u = static_cast<uint32_t>(u16(p + 2 * i)) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      out[i] = f;
    }
    return true;
  }
  int be = ref_block_elems(t), bb = ref_block_bytes(t);
  if (!be || n % be) return false;
  for (int64_t b = 0; b < n / be; ++b)
    for (int e = 0; e < be; ++e) out[b * be + e] = element(t, p + b * bb, e);
  return true;
}

}  // namespace moe::quant::test
