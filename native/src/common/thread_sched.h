// How the background thread asks the kernel's scheduler for prompt wake-ups, and how a
// rank binds its threads to its share of the host's cores.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace hvdlite {

// Gives the calling thread a short time slice (Linux 6.12+ EEVDF custom slice,
// sched_setattr's sched_runtime for SCHED_OTHER; no privilege needed, nice and share
// of the CPU unchanged). Returns whether the kernel took it.
bool RequestShortSlice(long slice_ns);

// The background thread's slice: the shortest the kernel takes.
constexpr long kBackgroundSliceNs = 100000;

// Where a rank runs, as far as cores go: the running kernel and the cores the process
// could use at start. A host name says less: the containers (or network namespaces) of
// one machine each have their own, and their ranks share its cores all the same.
struct CorePlace {
  char kernel[64];     // the kernel's boot id (the host name where it cannot be read)
  uint64_t cores[16];  // bit c: core c (the first 1024)
};
CorePlace ThisCorePlace();

// The ranks that share cores with this one: those on its kernel whose cores meet its
// own, itself included, and how many cores they have between them. Where ranks > cores
// a core is shared by several ranks' threads, and a thread that spins or runs real-time
// takes it from the others: waits sleep sooner, the background thread keeps the normal
// policy, and it does not follow the caller to its core.
struct CoreSharing {
  int ranks = 1;
  int cores = 0;
  bool crowded() const { return ranks > cores; }
};
// mine among every rank's places (`all`, in any order).
CoreSharing CountSharing(const CorePlace& mine, const std::vector<CorePlace>& all);

// Makes the calling thread real-time: SCHED_FIFO at the lowest priority, so that a wake
// takes a core from a normal thread at once, not after the tens of microseconds a short
// slice still waits. The background thread wakes ~20-30 times per training step (each
// gradient handed over, each chunk of a shared-memory allreduce a peer has moved on),
// and every late wake delays the peers too: on the MLP benchmark (2 ranks, 2 cores) it
// sat ~2 ms per 33 ms step runnable but not running, real-time ~0, and the step got
// ~2% faster (median of 44 interleaved rounds, quartiles 0.98-1.05; README "A real-time
// background thread").
// A real-time thread that spins keeps normal threads off its core (the kernel's
// real-time throttling, where it is on, bounds that to 95% of each second by default),
// so the background thread waits on futexes and in sleeping polls (their first ~10 us
// excepted), and runs MPI calls that spin until a peer arrives (blocking collectives on
// one host, communicator changes) under NormalPriorityScope. Threads it starts get the
// normal policy (SCHED_RESET_ON_FORK). Refused, with *why set, where more ranks share
// this process's cores than there are cores among them (CoreSharing): real-time threads
// of equal priority do not share a core by time slices. And refused when the kernel
// refuses (CAP_SYS_NICE, which containers often drop, or an RLIMIT_RTPRIO of at least 1).
bool RequestRealtime(const CoreSharing& sharing, std::string* why);
// Back to the normal policy and the short slice, for good (before shutting down).
// Nothing if the thread is not real-time.
void LeaveRealtime();
// While one lives, a real-time calling thread runs at the normal policy (with the short
// slice); nothing, without a syscall, for a thread that is not real-time.
class NormalPriorityScope {
 public:
  NormalPriorityScope();
  ~NormalPriorityScope();
  NormalPriorityScope(const NormalPriorityScope&) = delete;
  NormalPriorityScope& operator=(const NormalPriorityScope&) = delete;

 private:
  const bool lowered_;
};

// Calls done() until it is true or `limit` has passed; returns its last answer. For a
// wait whose end is usually microseconds away, before the wait sleeps (a sleep and its
// wake-up cost tens of microseconds): a bounded poll, never a spinning core.
template <typename Done>
bool PollUntil(std::chrono::microseconds limit, Done done) {
  const auto until = std::chrono::steady_clock::now() + limit;
  do {
    for (int i = 0; i < 32; ++i) {
      if (done()) return true;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  } while (std::chrono::steady_clock::now() < until);
  return done();
}

// How many cores this process could use when it started (before any binding); 0 when
// that cannot be read.
int CoresAtStartCount();

// Keeps the thread of kernel id `tid` on core `cpu` alone, or with cpu < 0 lets it run
// on every core the process started with. False where the kernel refused. A blocking
// caller keeps the background thread on its own core (Core::EnqueueAndWait): woken
// there, it takes the core the caller is about to give up, where a wake on another,
// idle core first waits for that core to leave its idle state (40-70 us a wake in the
// virtual machines measured, against ~10 us for the whole 4 KiB allreduce of one rank).
bool PlaceThread(int tid, int cpu);

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
