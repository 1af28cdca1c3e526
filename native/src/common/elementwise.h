// Element-wise kernels over whole buffers: the scaled copy used to pack tensors into a
// fusion buffer and unpack results, by the shared-memory collectives and the leader
// allreduce. Called from the background thread.
#pragma once

#include <cstdint>

#include "common/common.h"

namespace hvdlite {

// dst[i] = src[i] * factor / divisor, in the element type (integers: the product is
// truncated toward zero, then divided rounding toward negative infinity, as Horovod's
// integer Average does). factor 1 and
// divisor 1 make a plain copy; dst may equal src.
void ScaledCopy(void* dst, const void* src, int64_t count, int32_t dtype, double factor,
                int64_t divisor);

}  // namespace hvdlite
