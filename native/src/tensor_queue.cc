#include "tensor_queue.h"

#include <unordered_set>

namespace hvdlite {

static Status InFlight(const Request& q) {
  return Status(HVDLITE_ERR_DUPLICATE_NAME,
                std::string("a tensor named '") + q.name + "' is already in flight (" +
                    OpName(q.op) + "); wait for it before submitting another with the same name");
}

Status TensorQueue::Add(std::vector<TensorEntry> entries) {
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
      pending_.push_back(e.request);
      std::string name = e.request.name;
      entries_.emplace(std::move(name), std::move(e));
    }
  }
  work_cv_.notify_one();
  return Status::OK();
}

void TensorQueue::PopPending(std::vector<Request>* out) {
  std::lock_guard<std::mutex> lock(mutex_);
  out->swap(pending_);
  pending_.clear();
  woken_ = false;
}

TensorEntry* TensorQueue::Find(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

void TensorQueue::Remove(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.erase(name);
}

std::vector<hvdlite_handle_t> TensorQueue::TakeAll() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<hvdlite_handle_t> handles;
  for (auto& kv : entries_) handles.push_back(kv.second.handle);
  entries_.clear();
  pending_.clear();
  return handles;
}

void TensorQueue::WaitForWork(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  work_cv_.wait_until(lock, deadline, [&] { return !pending_.empty() || woken_; });
}

void TensorQueue::Wake() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    woken_ = true;
  }
  work_cv_.notify_one();
}

size_t TensorQueue::Size() {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

}  // namespace hvdlite
