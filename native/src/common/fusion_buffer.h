// The fusion buffer that packs many tensors into one collective: the executor's (fused
// allgathers, scratch space) and the backend's flat MPI allreduce share one per process
// set. Background thread only.
#pragma once

#include <cstdint>
#include <memory>

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
