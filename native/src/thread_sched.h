// How the background thread asks the kernel's scheduler for prompt wake-ups.
#pragma once

namespace hvdlite {

// Gives the calling thread a short time slice (Linux 6.12+ EEVDF custom slice,
// sched_setattr's sched_runtime for SCHED_OTHER; no privilege needed, nice and share
// of the CPU unchanged). Returns whether the kernel took it.
bool RequestShortSlice(long slice_ns);

// The background thread's slice: the shortest the kernel takes.
constexpr long kBackgroundSliceNs = 100000;

}  // namespace hvdlite
