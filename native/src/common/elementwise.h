// Element-wise kernels over whole buffers, in one place: the scaled copy (packing
// tensors into a fusion buffer, unpacking results), the reductions of the shared-memory
// collectives and the cross-host ring, and the 16-bit float reduction MPI lacks. Hot
// paths: each call takes a whole buffer; the loops are vectorized in blocks of 64 bytes
// and compiled for AVX2 and any x86-64 (HVDLITE_VECTOR_CLONES). Background thread.
#pragma once

#include <cstdint>
#include <vector>

#include "common/common.h"

namespace hvdlite {

// dst[i] = src[i] * factor / divisor, in the element type (integers: the product is
// truncated toward zero, then divided truncating toward zero, as Horovod's integer
// Average does). factor 1 and
// divisor 1 make a plain copy; dst may equal src.
void ScaledCopy(void* dst, const void* src, int64_t count, int32_t dtype, double factor,
                int64_t divisor);

// out = parts[0] op parts[1] op ... element by element, in that order (Average: Sum;
// 16-bit floats accumulate in float and round once). out may be parts[0]; no other
// part may overlap it.
void ReduceElements(void* out, const std::vector<const uint8_t*>& parts, int64_t n, int32_t dtype,
                    int32_t reduce_op);

// A rank's own part of a float Sum or Average, in one pass: slot = tensor = (parts[0] +
// parts[1] + ...) * scale, summed in rank order and scaled as ReduceElements and
// ScaledCopy would (the same bits). tensor may be one of the parts (in place).
void SumScaledInto(float* slot, float* tensor, const std::vector<const uint8_t*>& parts, int64_t n, float scale);
void SumScaledInto(double* slot, double* tensor, const std::vector<const uint8_t*>& parts, int64_t n, double scale);

// inout = in op inout, element by element, for float16 or bfloat16 (dtype): the
// reduction MPI has no type for (MPI's user-defined op order: in first).
void ReduceHalfInto(uint16_t* inout, const uint16_t* in, int64_t n, int32_t dtype, int32_t reduce_op);

}  // namespace hvdlite
