// Name -> entry of every op in flight in this process, plus the requests the
// background loop has not seen yet. Framework threads Add; the background thread
// pops, finds and removes. Only the background thread removes entries, so a pointer
// it got from Find stays valid until it calls Remove (unordered_map keeps element
// addresses stable across inserts).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/common.h"
#include "cycle/message.h"

namespace hvdlite {

using Clock = std::chrono::steady_clock;

struct TensorEntry {
  Request request;
  const void* input = nullptr;
  void* output = nullptr;
  const void* ready_event = nullptr;  // device tensors: the framework's cudaEvent_t
  hvdlite_handle_t handle = 0;
  Clock::time_point enqueued;
  bool popped = false;  // handed out by PopPending (else still in pending_). Queue mutex.
};

class TensorQueue {
 public:
  // All or nothing: refuses the batch if any name is already in flight. wake: wakes the
  // background thread's WaitForWork (not when the caller runs the cycle itself).
  Status Add(std::vector<TensorEntry> entries, bool wake = true);
  // The entries added since the last call, in order (out's old contents are dropped;
  // its capacity serves the next burst). They stay valid until removed, which only the
  // background thread does (or TakeAll once it has ended); an entry removed before it
  // was popped (a response can name a tensor this rank submitted after the cycle's
  // pop) leaves the pending list with it.
  void PopPending(std::vector<TensorEntry*>* out);
  // The entry of `name` alone, popped into out (as PopPending would), if no entry was
  // popped before and is still in flight: an op that then runs this cycle is that one.
  // Else false, and nothing popped. Other pending entries stay for the next pop.
  bool PopAlone(const std::string& name, std::vector<TensorEntry*>* out);
  // The entry of handle h popped into out, if it is the only entry of this rank (none
  // other pending or in flight), of host memory and of at most max_bytes of input;
  // else false, and nothing popped.
  bool PopOnly(hvdlite_handle_t h, int64_t max_bytes, std::vector<TensorEntry*>* out);
  TensorEntry* Find(const std::string& name);
  // Find for a list of names under one lock (null for a name not in flight).
  template <typename NameOf, typename T>
  std::vector<TensorEntry*> FindAll(const std::vector<T>& items, NameOf name_of);
  void Remove(const std::string& name);
  // Removes the entries and returns their handles, under one lock.
  std::vector<hvdlite_handle_t> RemoveAll(const std::vector<TensorEntry*>& entries);
  // Removes everything; returns the handles that were in flight.
  std::vector<hvdlite_handle_t> TakeAll();
  // Removes the entries of one process set; returns their handles and names.
  std::vector<std::pair<hvdlite_handle_t, std::string>> TakeSet(int32_t process_set);
  // Entries in flight, in all and per process set (ids with none left out).
  void CountBySet(int64_t* total, std::map<int32_t, int64_t>* by_set);
  // Background thread: sleeps until new requests arrive, Wake() is called, or
  // deadline. Returns whether requests are pending; *woken whether Wake() was called
  // (since the last pop).
  bool WaitForWork(Clock::time_point deadline, bool* woken);
  // Background thread, after WaitForWork: gathers a burst of submissions (a training
  // step's gradients, a loop of async calls) into one cycle. Returns once no request
  // was added for `quiet`, `blocked` (threads blocked waiting for a result, which
  // submit nothing meanwhile; any thread of the process counts) is above zero, Wake()
  // is called, or at deadline.
  void WaitForQuiet(Clock::duration quiet, Clock::time_point deadline,
                    const std::atomic<int>& blocked);
  // Call after `blocked` went up: ends a WaitForQuiet in progress. Called with the
  // handle table's mutex held; so nothing may take that mutex while holding this
  // queue's (nothing does).
  void Hurry();
  void Wake();
  size_t Size();

 private:
  // Erases the entry of `name` (if any), from the pending list too. mutex_ held.
  void EraseLocked(const std::string& name);

  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::unordered_map<std::string, TensorEntry> entries_;  // Guarded by mutex_.
  std::vector<TensorEntry*> pending_;                     // Guarded by mutex_.
  std::map<int32_t, int64_t> by_set_;  // process set -> entries in flight. Guarded by mutex_.
  bool woken_ = false;                                    // Guarded by mutex_.
  std::condition_variable quiet_cv_;                      // WaitForQuiet sleeps here
  Clock::time_point last_add_;                            // Guarded by mutex_.
  std::atomic<bool> gathering_{false};                    // in WaitForQuiet
};

template <typename NameOf, typename T>
std::vector<TensorEntry*> TensorQueue::FindAll(const std::vector<T>& items, NameOf name_of) {
  std::vector<TensorEntry*> found;
  found.reserve(items.size());
  std::lock_guard<std::mutex> lock(mutex_);
  for (const T& item : items) {
    auto it = entries_.find(name_of(item));
    found.push_back(it == entries_.end() ? nullptr : &it->second);
  }
  return found;
}

}  // namespace hvdlite
