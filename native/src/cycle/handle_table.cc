#include "cycle/handle_table.h"

#include <algorithm>
#include <chrono>
#include <cstring>

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

HandleTable::State* HandleTable::Live(hvdlite_handle_t h) {
  auto it = states_.find(h);
  return it == states_.end() || it->second.released ? nullptr : &it->second;
}

Status HandleTable::Recent(hvdlite_handle_t h) const {
  if (h <= 0 || h >= next_) return Missing(h);  // never handed out (the ring starts at 0s)
  auto it = states_.find(h);
  if (it != states_.end()) return it->second.status;  // released, waiters still leaving
  for (size_t i = 0; i < kRecentReleases; ++i) {
    if (recent_ids_[i] == h) return recent_statuses_[i];
  }
  return Missing(h);
}

void HandleTable::EraseIfUnused(hvdlite_handle_t h, const State& state) {
  if (!state.released || state.waiters > 0) return;
  recent_ids_[recent_next_] = h;
  recent_statuses_[recent_next_] = state.status;
  recent_next_ = (recent_next_ + 1) % kRecentReleases;
  states_.erase(h);
}

Status HandleTable::Poll(hvdlite_handle_t h, bool* done) {
  std::lock_guard<std::mutex> lock(mutex_);
  State* state = Live(h);
  if (!state) {
    Status recent = Recent(h);
    if (recent.code() == HVDLITE_ERR_INVALID_HANDLE) return recent;
    *done = true;  // released, so it had ended
    return Status::OK();
  }
  *done = state->done;
  return Status::OK();
}

Status HandleTable::Wait(hvdlite_handle_t h, double timeout_s, bool release, bool announced) {
  std::unique_lock<std::mutex> lock(mutex_);
  // This thread's share of blocked_ (and announced_), given back on every way out.
  struct Count {
    HandleTable* table;
    bool held, announced;
    ~Count() {
      if (held) table->blocked_.fetch_sub(1);
      if (announced) table->announced_.fetch_sub(1);
    }
  } count{this, announced, announced};
  // unordered_map references stay valid while other keys are inserted; a released
  // state is erased only once no thread waits on it.
  State* found = Live(h);
  if (!found) return Recent(h);
  State& state = *found;
  if (!state.done) {
    ++state.waiters;
    // A zero timeout is a poll: it does not count as a thread that submits no more.
    if (timeout_s != 0 && !count.held) {
      blocked_.fetch_add(1);
      count.held = true;
      // Outside the lock: on_block_ wakes the background thread, which (real-time, on
      // this thread's core) runs at once and may soon complete a handle, which takes
      // this lock. The state stays: it has a waiter.
      if (on_block_) {
        lock.unlock();
        on_block_();
        lock.lock();
      }
    }
    bool done = true;
    if (timeout_s < 0) {
      done_cv_.wait(lock, [&] { return state.done; });
    } else {
      done = done_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                               [&] { return state.done; });
    }
    --state.waiters;
    if (!done) {
      return Status(HVDLITE_ERR_TIMEOUT, "the op did not finish within " +
                                             std::to_string(timeout_s) + " s; it is still running");
    }
  }
  Status status = state.status;  // the state may go below
  if (release) state.released = true;
  EraseIfUnused(h, state);
  return status;
}

Status HandleTable::Finished(hvdlite_handle_t h, State** state) {
  *state = Live(h);
  if (!*state) return Missing(h);
  if (!(*state)->done) return Status(HVDLITE_ERR_IN_PROGRESS, "the op has not finished");
  if (!(*state)->status.ok()) return (*state)->status;
  return Status::OK();
}

Status HandleTable::Output(hvdlite_handle_t h, void** data, int64_t* nbytes, int64_t* first_dim) {
  std::lock_guard<std::mutex> lock(mutex_);
  State* state = nullptr;
  Status s = Finished(h, &state);
  if (!s.ok()) return s;
  *data = state->output.data.get();
  *nbytes = state->output.nbytes;
  *first_dim = state->output.first_dim;
  return Status::OK();
}

Status HandleTable::RecvSplits(hvdlite_handle_t h, std::vector<int64_t>* splits) {
  std::lock_guard<std::mutex> lock(mutex_);
  State* state = nullptr;
  Status s = Finished(h, &state);
  if (!s.ok()) return s;
  *splits = state->output.recv_splits;
  return Status::OK();
}

Status HandleTable::TakeOutput(hvdlite_handle_t h, void* dst, int64_t capacity, int64_t* nbytes,
                               int64_t* first_dim, int64_t* splits) {
  std::lock_guard<std::mutex> lock(mutex_);
  State* state = nullptr;
  Status s = Finished(h, &state);
  if (!s.ok()) return s;
  const OpOutput& output = state->output;
  *nbytes = output.nbytes;
  *first_dim = output.first_dim;
  if (output.nbytes > capacity) return Status::OK();
  if (output.nbytes > 0) std::memcpy(dst, output.data.get(), output.nbytes);
  if (splits) std::copy(output.recv_splits.begin(), output.recv_splits.end(), splits);
  state->released = true;
  EraseIfUnused(h, *state);
  return Status::OK();
}

Status HandleTable::Release(hvdlite_handle_t h) {
  std::lock_guard<std::mutex> lock(mutex_);
  State* state = Live(h);
  if (!state) return Status::OK();
  if (!state->done) {
    return Status(HVDLITE_ERR_IN_PROGRESS, "cannot release handle " + std::to_string(h) +
                                               ": its op is still in flight");
  }
  state->released = true;
  EraseIfUnused(h, *state);
  return Status::OK();
}

int HandleTable::ReleaseEnded(const hvdlite_handle_t* handles, int n) {
  std::lock_guard<std::mutex> lock(mutex_);
  int released = 0;
  for (int k = n - 1; k >= 0; --k, ++released) {
    State* state = Live(handles[k]);
    if (!state || !state->done || !state->status.ok()) break;
    state->released = true;
    EraseIfUnused(handles[k], *state);
  }
  return released;
}

}  // namespace hvdlite
