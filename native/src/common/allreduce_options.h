// An allreduce's arguments besides its buffers, as one struct that every layer running
// one passes on (shared memory, the hierarchical and leader allreduces, the backend).
#pragma once

#include <cstdint>

#include "hvdlite/c_api.h"

namespace hvdlite {

// out = reduce over ranks of (in * prescale), then * postscale / divisor, with
// ScaledCopy's rules (common/elementwise.h). Every rank passes the same values.
struct AllreduceOptions {
  int32_t dtype = HVDLITE_FLOAT32;
  int32_t reduce_op = HVDLITE_SUM;  // Average arrives as Sum with a divisor
  double prescale = 1.0;
  double postscale = 1.0;
  int64_t divisor = 1;  // Average: the ranks that contributed
};

}  // namespace hvdlite
