#include "common/fusion_buffer.h"

namespace hvdlite {

uint8_t* FusionBuffer::Get(int64_t nbytes) {
  if (nbytes > capacity_) {
    data_.reset(new uint8_t[nbytes]);
    capacity_ = nbytes;
  }
  return data_.get();
}

}  // namespace hvdlite
