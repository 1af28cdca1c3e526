// How the background thread asks the kernel's scheduler for prompt wake-ups, and how a
// rank binds its threads to its share of the host's cores.
#pragma once

#include <string>
#include <vector>

namespace hvdlite {

// Gives the calling thread a short time slice (Linux 6.12+ EEVDF custom slice,
// sched_setattr's sched_runtime for SCHED_OTHER; no privilege needed, nice and share
// of the CPU unchanged). Returns whether the kernel took it.
bool RequestShortSlice(long slice_ns);

// The background thread's slice: the shortest the kernel takes.
constexpr long kBackgroundSliceNs = 100000;

// Binds every thread of this process to local rank local_rank's share of the cores the
// process may use: the local_rank-th of local_size equal, contiguous blocks of them in
// number order (what is left over stays unused), as MPI's --bind-to core does. Threads
// started later by a bound thread inherit the binding. A rank's training thread and its
// background thread then share cores: the gradients one hands the other stay in that
// core's cache, and neither migrates to the other rank's core (the MLP benchmark on 2
// ranks and 2 cores: bound/unbound 1.014 median over 40 interleaved rounds; README
// "Binding ranks to cores").
// Returns the cores bound to; none, with *why set, when it could not bind (more ranks
// on the host than cores: every thread may then use all of them; or the kernel refused).
std::vector<int> BindToCoreShare(int local_rank, int local_size, std::string* why);

}  // namespace hvdlite
