// Handle -> status of one enqueued op. Framework threads create, wait, poll and
// release; the background thread completes. Waiters block on a condition variable.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include <sys/mman.h>

#include "common/common.h"

namespace hvdlite {

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};

// A core-allocated result (allgather, alltoall), owned by its handle. 64-byte aligned:
// frameworks that adopt external memory (TensorFlow through DLPack) require it. A large
// one is asked for in huge pages, as numpy asks for its arrays' (where the kernel's
// transparent huge pages are "madvise"): the collective writes every page of it first,
// and a 128 MiB allgather's result took ~60 ms of page faults in 4 KiB pages, ~15 in
// 2 MiB ones.
struct OpOutput {
  static constexpr size_t kHugePage = size_t{1} << 21;
  void Allocate(int64_t n) {
    size_t bytes = (static_cast<size_t>(n > 0 ? n : 1) + 63) / 64 * 64;
    const bool huge = bytes >= 2 * kHugePage;
    if (huge) bytes = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    data.reset(static_cast<uint8_t*>(std::aligned_alloc(huge ? kHugePage : 64, bytes)));
    if (!data) throw std::bad_alloc();
    if (huge) madvise(data.get(), bytes, MADV_HUGEPAGE);  // a hint: no huge pages, no harm
    nbytes = n;
  }
  std::unique_ptr<uint8_t, AlignedFree> data;
  int64_t nbytes = 0;
  int64_t first_dim = 0;
  std::vector<int64_t> recv_splits;
};

class HandleTable {
 public:
  hvdlite_handle_t Create();
  // Background thread: records the outcome and wakes waiters.
  void Complete(hvdlite_handle_t h, const Status& status, OpOutput output = OpOutput());
  // Complete for many handles with one status and no output, under one lock and with
  // at most one wake-up: a fused batch ends at once for its waiters.
  void CompleteAll(const std::vector<hvdlite_handle_t>& handles, const Status& status);
  Status Poll(hvdlite_handle_t h, bool* done);
  // Returns the op's status, or TIMEOUT with the op still running. release: Release
  // the handle too once the op has ended. announced: the calling thread called
  // Announce before it enqueued the op; this wait takes its count over.
  Status Wait(hvdlite_handle_t h, double timeout_s, bool release = false, bool announced = false);
  // A thread about to enqueue an op it will wait for at once counts as blocked from now
  // (see blocked()); Unannounce if the enqueue failed.
  void Announce() {
    blocked_.fetch_add(1);
    announced_.fetch_add(1);
  }
  void Unannounce() {
    blocked_.fetch_sub(1);
    announced_.fetch_sub(1);
  }
  // Threads waiting for a blocking op right now (announced, not yet returned): what the
  // shared-memory waits' polling follows (ShmCollectives::set_waits_may_poll). Not every
  // blocked thread: a training step's synchronize waits while the other rank's training
  // thread still computes, and a poll then takes a core it needs.
  const std::atomic<int>& announced() const { return announced_; }
  Status Output(hvdlite_handle_t h, void** data, int64_t* nbytes, int64_t* first_dim);
  Status RecvSplits(hvdlite_handle_t h, std::vector<int64_t>* splits);
  // Output's sizes; a result of at most capacity bytes is also copied to dst (and the
  // received splits to splits, when not null) and the handle released.
  Status TakeOutput(hvdlite_handle_t h, void* dst, int64_t capacity, int64_t* nbytes,
                    int64_t* first_dim, int64_t* splits);
  // Forgets an ended handle; while threads still wait on it (woken, not yet
  // returned), only marks it, and the last of them erases it. Its status stays known
  // to Wait and Poll for the next kRecentReleases releases (see Recent).
  Status Release(hvdlite_handle_t h);
  // Releases handles[n-1], handles[n-2], ... while each has ended successfully, under
  // one lock; returns how many it released (it stops at one in flight, failed or gone).
  int ReleaseEnded(const hvdlite_handle_t* handles, int n);
  static constexpr size_t kRecentReleases = 4096;
  // Threads blocked in Wait right now; on_block runs (handle lock not held) when a thread
  // is about to block.
  const std::atomic<int>& blocked() const { return blocked_; }
  void set_on_block(std::function<void()> on_block) { on_block_ = std::move(on_block); }

 private:
  struct State {
    bool done = false;
    bool released = false;  // Release was called; unknown to every call from now on
    int waiters = 0;  // threads in Wait on this handle: only they need a wake-up
    Status status;
    OpOutput output;
  };
  Status Missing(hvdlite_handle_t h) const;
  // The status of a released handle, as Wait reports it: its op's status while it is
  // among the recent releases, else Missing. A thread that reaches a handle just after
  // another released it (two threads waiting on one op), or a caller whose wait was
  // interrupted after the release, still learns how the op ended. mutex_ held.
  Status Recent(hvdlite_handle_t h) const;
  // The handle's state, or null when it is unknown or released. mutex_ held.
  State* Live(hvdlite_handle_t h);
  // The live state of an op that finished and succeeded (*state), else why not: the
  // handle is unknown or released, the op is still running, or the op's error. mutex_
  // held.
  Status Finished(hvdlite_handle_t h, State** state);
  // Erases a released state once no thread waits on it. mutex_ held.
  void EraseIfUnused(hvdlite_handle_t h, const State& state);

  std::mutex mutex_;
  std::condition_variable done_cv_;
  std::unordered_map<hvdlite_handle_t, State> states_;  // Guarded by mutex_.
  // The last kRecentReleases released handles and their statuses, a ring written at
  // recent_next_ (ids apart from statuses: Recent scans the ids). Guarded by mutex_.
  std::vector<hvdlite_handle_t> recent_ids_ = std::vector<hvdlite_handle_t>(kRecentReleases, 0);
  std::vector<Status> recent_statuses_ = std::vector<Status>(kRecentReleases);
  size_t recent_next_ = 0;
  hvdlite_handle_t next_ = 1;                           // Guarded by mutex_.
  std::atomic<int> blocked_{0};    // threads in Wait with a timeout other than 0, or announced
  std::atomic<int> announced_{0};  // of those, the announced
  std::function<void()> on_block_;  // set once by Core::Get, before any other thread
};

}  // namespace hvdlite
