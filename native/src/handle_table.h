// Handle -> status of one enqueued op. Framework threads create, wait, poll and
// release; the background thread completes. Waiters block on a condition variable.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common.h"

namespace hvdlite {

// A core-allocated result (allgather, alltoall), owned by its handle.
struct OpOutput {
  std::unique_ptr<uint8_t[]> data;
  int64_t nbytes = 0;
  int64_t first_dim = 0;
  std::vector<int64_t> recv_splits;
};

class HandleTable {
 public:
  hvdlite_handle_t Create();
  // Background thread: records the outcome and wakes waiters.
  void Complete(hvdlite_handle_t h, const Status& status, OpOutput output = OpOutput());
  Status Poll(hvdlite_handle_t h, bool* done);
  // Returns the op's status, or TIMEOUT with the op still running.
  Status Wait(hvdlite_handle_t h, double timeout_s);
  Status Output(hvdlite_handle_t h, void** data, int64_t* nbytes, int64_t* first_dim);
  Status RecvSplits(hvdlite_handle_t h, std::vector<int64_t>* splits);
  Status Release(hvdlite_handle_t h);
  size_t Live();

 private:
  struct State {
    bool done = false;
    Status status;
    OpOutput output;
  };
  Status Missing(hvdlite_handle_t h) const;

  std::mutex mutex_;
  std::condition_variable done_cv_;
  std::unordered_map<hvdlite_handle_t, State> states_;  // Guarded by mutex_.
  hvdlite_handle_t next_ = 1;                           // Guarded by mutex_.
};

}  // namespace hvdlite
