#include "common/elementwise.h"

#include <cstring>

#include "common/half.h"

namespace hvdlite {
namespace {

// Integer Average rounds toward negative infinity, as Horovod's (floor_divide) does.
template <typename T>
void ScaleInt(T* dst, const T* src, int64_t n, double factor, int64_t divisor) {
  for (int64_t i = 0; i < n; ++i) {
    int64_t v = factor == 1.0 ? static_cast<int64_t>(src[i])
                              : static_cast<int64_t>(static_cast<double>(src[i]) * factor);
    int64_t q = v / divisor;
    if (v % divisor != 0 && (v < 0) != (divisor < 0)) --q;
    dst[i] = static_cast<T>(q);
  }
}

// In blocks of a fixed 64 bytes, which -O2 vectorizes (a loop of unknown length it
// leaves scalar). dst may equal src, so no restrict.
template <typename T>
HVDLITE_VECTOR_CLONES
void ScaleFloat(T* dst, const T* src, int64_t n, double scale) {
  const T s = static_cast<T>(scale);
  constexpr int64_t kBlock = 64 / sizeof(T);
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    T block[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) block[j] = src[i + j] * s;
    for (int64_t j = 0; j < kBlock; ++j) dst[i + j] = block[j];
  }
  for (; i < n; ++i) dst[i] = src[i] * s;
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void Scale16(uint16_t* dst, const uint16_t* src, int64_t n, double scale) {
  const float s = static_cast<float>(scale);
  for (int64_t i = 0; i < n; ++i) dst[i] = FromF(ToF(src[i]) * s);
}

}  // namespace

void ScaledCopy(void* dst, const void* src, int64_t count, int32_t dtype, double factor,
                int64_t divisor) {
  if (factor == 1.0 && divisor == 1) {
    if (dst != src && count > 0) std::memcpy(dst, src, count * ElementSize(dtype));
    return;
  }
  double scale = factor / static_cast<double>(divisor);
  switch (dtype) {
    case HVDLITE_UINT8: case HVDLITE_BOOL:
      ScaleInt(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), count, factor, divisor);
      break;
    case HVDLITE_INT8:
      ScaleInt(static_cast<int8_t*>(dst), static_cast<const int8_t*>(src), count, factor, divisor);
      break;
    case HVDLITE_INT16:
      ScaleInt(static_cast<int16_t*>(dst), static_cast<const int16_t*>(src), count, factor, divisor);
      break;
    case HVDLITE_UINT16:
      ScaleInt(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count, factor, divisor);
      break;
    case HVDLITE_INT32:
      ScaleInt(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), count, factor, divisor);
      break;
    case HVDLITE_INT64:
      ScaleInt(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), count, factor, divisor);
      break;
    case HVDLITE_FLOAT16:
      Scale16<HalfToFloat, FloatToHalf>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count, scale);
      break;
    case HVDLITE_BFLOAT16:
      Scale16<Bf16ToFloat, FloatToBf16>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count, scale);
      break;
    case HVDLITE_FLOAT32:
      ScaleFloat(static_cast<float*>(dst), static_cast<const float*>(src), count, scale);
      break;
    case HVDLITE_FLOAT64:
      ScaleFloat(static_cast<double*>(dst), static_cast<const double*>(src), count, scale);
      break;
  }
}

}  // namespace hvdlite
