// ggml's block formats (the tensor types of a GGUF file) as the kernels read
// them: the size of each block, in values and in bytes. A row of k values is
// k / block_elems blocks laid end to end, exactly as the file stores it.
// ggml_impl.h decodes each format; this table is the one place its sizes live.
#pragma once

#include <cstdint>

#include "kernels/kernels.h"

namespace pyloader::kernels {

struct GgmlFormat {
  GgmlType type;
  const char* name;  // as gguf names the type
  int block_elems;
  int block_bytes;
};

// Indexed by GgmlType.
//   F32, F16, BF16: one value a block.
//   Q4_0 d, 16 bytes of 4-bit codes: d * (q - 8).
//   Q4_1 d, m, 16 bytes of 4-bit codes: d * q + m.
//   Q5_0 d, 32 high bits, 16 bytes of low nibbles: d * (q - 16).
//   Q5_1 d, m, 32 high bits, 16 bytes of low nibbles: d * q + m.
//   Q8_0 d, 32 signed bytes: d * q.
//   Q2_K 16 bytes of 4-bit scale and min pairs, 64 bytes of 2-bit codes, d, dmin.
//   Q3_K 32 bytes of high bits, 64 bytes of 2-bit low parts, 12 bytes of sixteen
//        6-bit scales, d.
//   Q4_K d, dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles.
//   Q5_K as Q4_K with 32 bytes of high bits before the nibbles.
//   Q6_K 128 bytes of low nibbles, 64 of high 2-bit parts, 16 signed scales, d.
// d, m and dmin are float16.
inline constexpr GgmlFormat kGgmlFormats[] = {
    {GgmlType::F32, "F32", 1, 4},        {GgmlType::F16, "F16", 1, 2},
    {GgmlType::BF16, "BF16", 1, 2},      {GgmlType::Q4_0, "Q4_0", 32, 18},
    {GgmlType::Q4_1, "Q4_1", 32, 20},    {GgmlType::Q5_0, "Q5_0", 32, 22},
    {GgmlType::Q5_1, "Q5_1", 32, 24},    {GgmlType::Q8_0, "Q8_0", 32, 34},
    {GgmlType::Q2_K, "Q2_K", 256, 84},   {GgmlType::Q3_K, "Q3_K", 256, 110},
    {GgmlType::Q4_K, "Q4_K", 256, 144},  {GgmlType::Q5_K, "Q5_K", 256, 176},
    {GgmlType::Q6_K, "Q6_K", 256, 210},
};

constexpr bool formats_in_type_order() {
  int i = 0;
  for (const GgmlFormat& f : kGgmlFormats)
    if (static_cast<int>(f.type) != i++) return false;
  return true;
}
static_assert(formats_in_type_order(), "kGgmlFormats is indexed by GgmlType");

constexpr const GgmlFormat& ggml_format(GgmlType t) {
  return kGgmlFormats[static_cast<int>(t)];
}

}  // namespace pyloader::kernels
