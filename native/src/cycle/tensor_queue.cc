#include "cycle/tensor_queue.h"

#include <algorithm>
#include <unordered_set>

namespace hvdlite {

static Status InFlight(const Request& q) {
  return Status(HVDLITE_ERR_DUPLICATE_NAME,
                std::string("a tensor named '") + q.name + "' is already in flight (" +
                    OpName(q.op) + "); wait for it before submitting another with the same name");
}

Status TensorQueue::Add(std::vector<TensorEntry> entries, bool wake) {
  // Names repeated inside a group are checked before taking the lock; a single tensor
  // (the per-gradient path) needs no set at all.
  if (entries.size() > 1) {
    std::unordered_set<std::string> batch;
    for (const TensorEntry& e : entries) {
      if (!batch.insert(e.request.name).second) return InFlight(e.request);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const TensorEntry& e : entries) {
      if (entries_.count(e.request.name)) return InFlight(e.request);
    }
    for (TensorEntry& e : entries) {
      ++by_set_[e.request.process_set];
      std::string name = e.request.name;
      pending_.push_back(&entries_.emplace(std::move(name), std::move(e)).first->second);
    }
    last_add_ = entries.front().enqueued;
  }
  if (wake) work_cv_.notify_one();
  return Status::OK();
}

bool TensorQueue::PopAlone(const std::string& name, std::vector<TensorEntry*>* out) {
  out->clear();
  std::lock_guard<std::mutex> lock(mutex_);
  if (entries_.size() != pending_.size()) return false;  // one was popped and is in flight
  auto it = entries_.find(name);
  if (it == entries_.end()) return false;
  auto pending = std::find(pending_.begin(), pending_.end(), &it->second);
  if (pending == pending_.end()) return false;
  pending_.erase(pending);
  it->second.popped = true;
  out->push_back(&it->second);
  return true;
}

bool TensorQueue::PopOnly(hvdlite_handle_t h, int64_t max_bytes, std::vector<TensorEntry*>* out) {
  out->clear();
  std::lock_guard<std::mutex> lock(mutex_);
  if (entries_.size() != 1 || pending_.size() != 1) return false;
  TensorEntry* e = pending_.front();
  const Request& q = e->request;
  if (e->handle != h || q.device >= 0 || NumElements(q.shape) * ElementSize(q.dtype) > max_bytes) {
    return false;
  }
  pending_.clear();
  e->popped = true;
  out->push_back(e);
  return true;
}

void TensorQueue::PopPending(std::vector<TensorEntry*>* out) {
  out->clear();
  std::lock_guard<std::mutex> lock(mutex_);
  out->swap(pending_);
  for (TensorEntry* e : *out) e->popped = true;
  woken_ = false;
}

void TensorQueue::EraseLocked(const std::string& name) {
  auto it = entries_.find(name);
  if (it == entries_.end()) return;
  auto count = by_set_.find(it->second.request.process_set);
  if (--count->second == 0) by_set_.erase(count);
  // `name` may be the entry's own: not used after the erase.
  if (!it->second.popped) {
    auto pending = std::find(pending_.begin(), pending_.end(), &it->second);
    if (pending != pending_.end()) pending_.erase(pending);
  }
  entries_.erase(it);
}

TensorEntry* TensorQueue::Find(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

void TensorQueue::Remove(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  EraseLocked(name);
}

std::vector<hvdlite_handle_t> TensorQueue::RemoveAll(const std::vector<TensorEntry*>& entries) {
  std::vector<hvdlite_handle_t> handles;
  handles.reserve(entries.size());
  std::lock_guard<std::mutex> lock(mutex_);
  for (TensorEntry* e : entries) {
    if (!e) continue;
    handles.push_back(e->handle);
    EraseLocked(e->request.name);
  }
  return handles;
}

std::vector<hvdlite_handle_t> TensorQueue::TakeAll() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<hvdlite_handle_t> handles;
  for (auto& kv : entries_) handles.push_back(kv.second.handle);
  entries_.clear();
  pending_.clear();
  by_set_.clear();
  return handles;
}

std::vector<std::pair<hvdlite_handle_t, std::string>> TensorQueue::TakeSet(int32_t process_set) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<hvdlite_handle_t, std::string>> taken;
  for (const auto& kv : entries_) {
    if (kv.second.request.process_set == process_set) taken.emplace_back(kv.second.handle, kv.first);
  }
  for (const auto& t : taken) EraseLocked(t.second);
  return taken;
}

void TensorQueue::CountBySet(int64_t* total, std::map<int32_t, int64_t>* by_set) {
  std::lock_guard<std::mutex> lock(mutex_);
  *total = static_cast<int64_t>(entries_.size());
  *by_set = by_set_;
}

bool TensorQueue::WaitForWork(Clock::time_point deadline, bool* woken) {
  std::unique_lock<std::mutex> lock(mutex_);
  work_cv_.wait_until(lock, deadline, [&] { return !pending_.empty() || woken_; });
  *woken = woken_;
  return !pending_.empty();
}

void TensorQueue::WaitForQuiet(Clock::duration quiet, Clock::time_point deadline,
                               const std::atomic<int>& blocked) {
  std::unique_lock<std::mutex> lock(mutex_);
  gathering_.store(true);
  // Until `quiet` after the latest request: Adds move that on without waking this wait
  // (they notify work_cv_), or the submitting thread and this one would trade the CPU
  // for every request. A thread that blocks on a result either sees gathering_ and
  // wakes this wait (Hurry), or its blocked count is seen here (both sequentially
  // consistent).
  auto done = [&] { return blocked.load() > 0 || woken_; };
  while (!done()) {
    const auto until = std::min(last_add_ + quiet, deadline);
    if (Clock::now() >= until) break;
    quiet_cv_.wait_until(lock, until, done);
  }
  gathering_.store(false);
}

void TensorQueue::Hurry() {
  if (!gathering_.load()) return;  // the usual case: no lock
  { std::lock_guard<std::mutex> lock(mutex_); }  // WaitForQuiet is in its wait, or past it
  quiet_cv_.notify_one();
}

void TensorQueue::Wake() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    woken_ = true;
  }
  work_cv_.notify_one();
  quiet_cv_.notify_one();
}

size_t TensorQueue::Size() {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

}  // namespace hvdlite
