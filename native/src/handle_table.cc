#include "handle_table.h"

#include <chrono>

namespace hvdlite {

hvdlite_handle_t HandleTable::Create() {
  std::lock_guard<std::mutex> lock(mutex_);
  hvdlite_handle_t h = next_++;
  states_.emplace(h, State());
  return h;
}

void HandleTable::Complete(hvdlite_handle_t h, const Status& status, OpOutput output) {
  bool waited;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = states_.find(h);
    if (it == states_.end()) return;
    it->second.done = true;
    it->second.status = status;
    it->second.output = std::move(output);
    waited = it->second.waiters > 0;
  }
  // A fused batch completes many handles at once while the training thread waits on
  // one of them: waking it for every other handle would cost a system call each.
  if (waited) done_cv_.notify_all();
}

void HandleTable::CompleteAll(const std::vector<hvdlite_handle_t>& handles, const Status& status) {
  bool waited = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (hvdlite_handle_t h : handles) {
      auto it = states_.find(h);
      if (it == states_.end()) continue;
      it->second.done = true;
      it->second.status = status;
      waited |= it->second.waiters > 0;
    }
  }
  if (waited) done_cv_.notify_all();
}

Status HandleTable::Missing(hvdlite_handle_t h) const {
  return Status(HVDLITE_ERR_INVALID_HANDLE,
                "handle " + std::to_string(h) + " is unknown or was already released");
}

Status HandleTable::Poll(hvdlite_handle_t h, bool* done) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = states_.find(h);
  if (it == states_.end()) return Missing(h);
  *done = it->second.done;
  return Status::OK();
}

Status HandleTable::Wait(hvdlite_handle_t h, double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = states_.find(h);
  if (it == states_.end()) return Missing(h);
  // unordered_map references stay valid while other keys are inserted; only Release
  // erases, and releasing a handle someone waits on is refused (IN_PROGRESS).
  State& state = it->second;
  if (!state.done) {
    ++state.waiters;
    // A zero timeout is a poll: it does not count as a thread that submits no more.
    const bool blocks = timeout_s != 0;
    if (blocks) {
      blocked_.fetch_add(1);
      if (on_block_) on_block_();
    }
    bool done = true;
    if (timeout_s < 0) {
      done_cv_.wait(lock, [&] { return state.done; });
    } else {
      done = done_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                               [&] { return state.done; });
    }
    --state.waiters;
    if (blocks) blocked_.fetch_sub(1);
    if (!done) {
      return Status(HVDLITE_ERR_TIMEOUT, "the op did not finish within " +
                                             std::to_string(timeout_s) + " s; it is still running");
    }
  }
  return state.status;
}

Status HandleTable::Output(hvdlite_handle_t h, void** data, int64_t* nbytes, int64_t* first_dim) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = states_.find(h);
  if (it == states_.end()) return Missing(h);
  if (!it->second.done) return Status(HVDLITE_ERR_IN_PROGRESS, "the op has not finished");
  if (!it->second.status.ok()) return it->second.status;
  *data = it->second.output.data.get();
  *nbytes = it->second.output.nbytes;
  *first_dim = it->second.output.first_dim;
  return Status::OK();
}

Status HandleTable::RecvSplits(hvdlite_handle_t h, std::vector<int64_t>* splits) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = states_.find(h);
  if (it == states_.end()) return Missing(h);
  if (!it->second.done) return Status(HVDLITE_ERR_IN_PROGRESS, "the op has not finished");
  if (!it->second.status.ok()) return it->second.status;
  *splits = it->second.output.recv_splits;
  return Status::OK();
}

Status HandleTable::Release(hvdlite_handle_t h) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = states_.find(h);
  if (it == states_.end()) return Status::OK();
  if (!it->second.done) {
    return Status(HVDLITE_ERR_IN_PROGRESS, "cannot release handle " + std::to_string(h) +
                                               ": its op is still in flight");
  }
  states_.erase(it);
  return Status::OK();
}

}  // namespace hvdlite
