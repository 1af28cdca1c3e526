#include "common/elementwise.h"

#include <cstring>
#include <type_traits>

#include "common/half.h"

namespace hvdlite {
namespace {

// Integer Average truncates toward zero, as Horovod's does (it multiplies the sum by
// 1/size in double and converts back; its own test divides with rounding_mode='trunc').
// The division here is exact where the double product would round for large values.
template <typename T>
void ScaleInt(T* dst, const T* src, int64_t n, double factor, int64_t divisor) {
  for (int64_t i = 0; i < n; ++i) {
    int64_t v = factor == 1.0 ? static_cast<int64_t>(src[i])
                              : static_cast<int64_t>(static_cast<double>(src[i]) * factor);
    dst[i] = static_cast<T>(v / divisor);  // C++ division truncates toward zero
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

// Integers wrap (two's complement), as MPI's do: the arithmetic runs in the unsigned
// type, where overflow is defined.
template <typename T, bool = std::is_integral_v<T>>
struct ArithOf {
  using type = T;
};
template <typename T>
struct ArithOf<T, true> {
  using type = std::make_unsigned_t<T>;
};
template <typename T>
using Arith = typename ArithOf<T>::type;

struct SumOp {
  template <typename T>
  T operator()(T a, T b) const {
    return static_cast<T>(static_cast<Arith<T>>(a) + static_cast<Arith<T>>(b));
  }
};
struct ProductOp {
  template <typename T>
  T operator()(T a, T b) const {
    return static_cast<T>(static_cast<Arith<T>>(a) * static_cast<Arith<T>>(b));
  }
};
struct MinOp {
  template <typename T>
  T operator()(T a, T b) const { return b < a ? b : a; }
};
struct MaxOp {
  template <typename T>
  T operator()(T a, T b) const { return a < b ? b : a; }
};

// out = parts[0] op parts[1] op ... (in rank order), element by element. Two-input
// loops over restrict pointers, in blocks of a fixed 64 bytes: -O2 vectorizes those
// (it leaves loops of unknown length scalar, as they would need a remainder loop).
// Combine and Accumulate stay two functions: restrict needs distinct pointers, and a
// single version that lets out alias an input (through a local block) ran ~30% slower.
constexpr int64_t kBlockBytes = 64;

template <typename T, typename Op>
HVDLITE_VECTOR_CLONES
void Combine(T* __restrict out, const T* __restrict a, const T* __restrict b, int64_t n, Op op) {
  constexpr int64_t kBlock = kBlockBytes / sizeof(T);
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) out[i + j] = op(a[i + j], b[i + j]);
  }
  for (; i < n; ++i) out[i] = op(a[i], b[i]);
}

template <typename T, typename Op>
HVDLITE_VECTOR_CLONES
void Accumulate(T* __restrict out, const T* __restrict b, int64_t n, Op op) {
  constexpr int64_t kBlock = kBlockBytes / sizeof(T);
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) out[i + j] = op(out[i + j], b[i + j]);
  }
  for (; i < n; ++i) out[i] = op(out[i], b[i]);
}

// The parts a reduction reads, in rank order: a vector's, or a fixed list's (MPI's
// two-input callback), without building a vector per call.
struct Parts {
  Parts(const std::vector<const uint8_t*>& v) : at(v.data()), n(v.size()) {}
  Parts(const uint8_t* const* p, size_t count) : at(p), n(count) {}
  size_t size() const { return n; }
  const uint8_t* operator[](size_t i) const { return at[i]; }
  const uint8_t* const* at;
  size_t n;
};

template <typename T, typename Op>
void ReduceParts(void* out, Parts parts, int64_t n, Op op) {
  T* o = static_cast<T*>(out);
  size_t k = 1;  // out is parts[0] already: accumulate the rest into it
  if (out != parts[0]) {
    Combine(o, reinterpret_cast<const T*>(parts[0]), reinterpret_cast<const T*>(parts[1]), n, op);
    k = 2;
  }
  for (; k < parts.size(); ++k) Accumulate(o, reinterpret_cast<const T*>(parts[k]), n, op);
}

// A rank's own part of a float Sum or Average, in one pass: slot = tensor =
// (parts[0] + parts[1] + ...) * scale, summed in rank order and scaled as ReduceParts
// and ScaledCopy would (the same bits). tensor may be one of the parts (in place):
// each 64-byte block is summed into a local block before either store. Against reduce,
// scale, copy out, this saves two passes over the part (~10% of the background
// thread's CPU on the MLP benchmark's 23 MB).
template <typename T>
HVDLITE_VECTOR_CLONES
void SumScaledIntoTyped(T* slot, T* tensor, const std::vector<const uint8_t*>& parts, int64_t n, T scale) {
  constexpr int64_t kBlock = kBlockBytes / sizeof(T);
  const T* p0 = reinterpret_cast<const T*>(parts[0]);
  const T* p1 = reinterpret_cast<const T*>(parts[1]);
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    T b[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) b[j] = p0[i + j] + p1[i + j];
    for (size_t r = 2; r < parts.size(); ++r) {
      const T* pr = reinterpret_cast<const T*>(parts[r]);
      for (int64_t j = 0; j < kBlock; ++j) b[j] += pr[i + j];
    }
    if (scale != T(1)) for (int64_t j = 0; j < kBlock; ++j) b[j] *= scale;
    for (int64_t j = 0; j < kBlock; ++j) slot[i + j] = b[j];
    for (int64_t j = 0; j < kBlock; ++j) tensor[i + j] = b[j];
  }
  for (; i < n; ++i) {
    T v = p0[i] + p1[i];
    for (size_t r = 2; r < parts.size(); ++r) v += reinterpret_cast<const T*>(parts[r])[i];
    if (scale != T(1)) v *= scale;
    slot[i] = v;
    tensor[i] = v;
  }
}

// 16-bit floats: accumulated in float over every part, rounded once. Each element's
// parts are all read before out is written, so out may be any part.
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), typename Op>
void ReduceHalfParts(void* out, Parts parts, int64_t n, Op op) {
  uint16_t* o = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) {
    float acc = ToF(reinterpret_cast<const uint16_t*>(parts[0])[i]);
    for (size_t k = 1; k < parts.size(); ++k) {
      acc = op(acc, ToF(reinterpret_cast<const uint16_t*>(parts[k])[i]));
    }
    o[i] = FromF(acc);
  }
}

template <typename Op>
void ReduceTyped(void* out, Parts parts, int64_t n, int32_t dtype, Op op) {
  switch (dtype) {
    case HVDLITE_UINT8: case HVDLITE_BOOL: return ReduceParts<uint8_t>(out, parts, n, op);
    case HVDLITE_INT8: return ReduceParts<int8_t>(out, parts, n, op);
    case HVDLITE_INT16: return ReduceParts<int16_t>(out, parts, n, op);
    case HVDLITE_UINT16: return ReduceParts<uint16_t>(out, parts, n, op);
    case HVDLITE_INT32: return ReduceParts<int32_t>(out, parts, n, op);
    case HVDLITE_INT64: return ReduceParts<int64_t>(out, parts, n, op);
    case HVDLITE_FLOAT16: return ReduceHalfParts<HalfToFloat, FloatToHalf>(out, parts, n, op);
    case HVDLITE_BFLOAT16: return ReduceHalfParts<Bf16ToFloat, FloatToBf16>(out, parts, n, op);
    case HVDLITE_FLOAT32: return ReduceParts<float>(out, parts, n, op);
    default: return ReduceParts<double>(out, parts, n, op);
  }
}

void ReduceAll(void* out, Parts parts, int64_t n, int32_t dtype, int32_t reduce_op) {
  switch (reduce_op) {
    case HVDLITE_MIN: return ReduceTyped(out, parts, n, dtype, MinOp());
    case HVDLITE_MAX: return ReduceTyped(out, parts, n, dtype, MaxOp());
    case HVDLITE_PRODUCT: return ReduceTyped(out, parts, n, dtype, ProductOp());
    default: return ReduceTyped(out, parts, n, dtype, SumOp());  // Sum; Average is a scaled Sum
  }
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

void ReduceElements(void* out, const std::vector<const uint8_t*>& parts, int64_t n, int32_t dtype,
                    int32_t reduce_op) {
  ReduceAll(out, parts, n, dtype, reduce_op);
}

void SumScaledInto(float* slot, float* tensor, const std::vector<const uint8_t*>& parts, int64_t n, float scale) {
  SumScaledIntoTyped(slot, tensor, parts, n, scale);
}

void SumScaledInto(double* slot, double* tensor, const std::vector<const uint8_t*>& parts, int64_t n, double scale) {
  SumScaledIntoTyped(slot, tensor, parts, n, scale);
}

void ReduceHalfInto(uint16_t* inout, const uint16_t* in, int64_t n, int32_t dtype, int32_t reduce_op) {
  const uint8_t* const parts[] = {reinterpret_cast<const uint8_t*>(in),
                                   reinterpret_cast<const uint8_t*>(inout)};
  ReduceAll(inout, Parts(parts, 2), n, dtype, reduce_op);
}

}  // namespace hvdlite
