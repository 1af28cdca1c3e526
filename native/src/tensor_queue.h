// Name -> entry of every op in flight in this process, plus the requests the
// background loop has not seen yet. Framework threads Add; the background thread
// pops, finds and removes. Only the background thread removes entries, so a pointer
// it got from Find stays valid until it calls Remove (unordered_map keeps element
// addresses stable across inserts).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "message.h"

namespace hvdlite {

using Clock = std::chrono::steady_clock;

struct TensorEntry {
  Request request;
  const void* input = nullptr;
  void* output = nullptr;
  hvdlite_handle_t handle = 0;
  Clock::time_point enqueued;
};

class TensorQueue {
 public:
  // All or nothing: refuses the batch if any name is already in flight.
  Status Add(std::vector<TensorEntry> entries);
  void PopPending(std::vector<Request>* out);
  TensorEntry* Find(const std::string& name);
  void Remove(const std::string& name);
  // Removes everything; returns the handles that were in flight.
  std::vector<hvdlite_handle_t> TakeAll();
  // Background thread: sleeps until new requests arrive, Wake() is called, or deadline.
  void WaitForWork(Clock::time_point deadline);
  void Wake();
  size_t Size();

 private:
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::unordered_map<std::string, TensorEntry> entries_;  // Guarded by mutex_.
  std::vector<Request> pending_;                          // Guarded by mutex_.
  bool woken_ = false;                                    // Guarded by mutex_.
};

}  // namespace hvdlite
