// The fusion buffer and the element-wise copy-with-scaling used to pack tensors into
// it and unpack results out of it. Background thread only.
#pragma once

#include <cstdint>
#include <memory>

#include "common.h"

namespace hvdlite {

// dst[i] = src[i] * factor / divisor, in the element type (integers: the product is
// truncated toward zero, then divided rounding toward negative infinity, as Horovod's
// integer Average does). factor 1 and
// divisor 1 make a plain copy; dst may equal src.
void ScaledCopy(void* dst, const void* src, int64_t count, int32_t dtype, double factor,
                int64_t divisor);

// A host buffer that grows to the largest fused collective and is reused.
class FusionBuffer {
 public:
  uint8_t* Get(int64_t nbytes);

 private:
  std::unique_ptr<uint8_t[]> data_;
  int64_t capacity_ = 0;
};

}  // namespace hvdlite
