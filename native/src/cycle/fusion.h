// The fusion buffer that packs many tensors into one collective (the scaled copy that
// packs and unpacks it is in common/elementwise.h). Background thread only.
#pragma once

#include <cstdint>
#include <memory>

#include "common/common.h"
#include "common/elementwise.h"

namespace hvdlite {

// A host buffer that grows to the largest fused collective and is reused.
class FusionBuffer {
 public:
  uint8_t* Get(int64_t nbytes);

 private:
  std::unique_ptr<uint8_t[]> data_;
  int64_t capacity_ = 0;
};

}  // namespace hvdlite
