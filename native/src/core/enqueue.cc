// Enqueue: validates the tensors of a call against their process set and adds them to
// the queue, each with a handle. Any framework thread; the queue and the handle table
// lock themselves.
#include "core/core.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/thread_sched.h"

namespace hvdlite {
namespace {

// The input bytes of a tensor on host memory, -1 for any other (or an invalid one,
// which Validate refuses).
int64_t HostTensorBytes(const hvdlite_tensor_t* t) {
  if (!t || t->device >= 0 || t->ndim < 0 || (t->ndim > 0 && !t->shape) || !ValidDtype(t->dtype)) return -1;
  constexpr int64_t kMost = std::numeric_limits<int64_t>::max();
  int64_t bytes = ElementSize(t->dtype);
  for (int i = 0; i < t->ndim; ++i) {
    const int64_t d = std::max<int64_t>(t->shape[i], 0);
    if (d > 0 && bytes > kMost / d) return kMost;  // more than any op a caller runs
    bytes *= d;
  }
  return bytes;
}

}  // namespace

Status Core::Validate(const hvdlite_tensor_t& t, int64_t index, const ProcessSetMembers& set) const {
  // Built only for an error message: this runs for every tensor of every step.
  auto who = [&] {
    return t.name ? std::string("tensor '") + t.name + "'" : "tensor #" + std::to_string(index);
  };
  if (!t.name || !*t.name) return InvalidArgument(who() + ": a name is required");
  if (std::strlen(t.name) > kMaxNameBytes) {
    return InvalidArgument("tensor name of " + std::to_string(std::strlen(t.name)) +
                           " bytes is too long (at most " + std::to_string(kMaxNameBytes) + ")");
  }
  if (!ValidOp(t.op)) return InvalidArgument(who() + ": unknown op " + std::to_string(t.op));
  if (!ValidDtype(t.dtype)) return InvalidArgument(who() + ": unsupported dtype code " + std::to_string(t.dtype));
  // (The table changes carry a set's ranks as their shape.)
  if (t.ndim < 0 || (t.ndim > 64 && t.op < HVDLITE_OP_ADD_PROCESS_SET) || (t.ndim > 0 && !t.shape)) {
    return InvalidArgument(who() + ": invalid number of dimensions " + std::to_string(t.ndim));
  }
  int64_t elems = 1;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) return InvalidArgument(who() + ": negative dimension in its shape");
    elems *= t.shape[i];
  }
  const char* op = OpName(t.op);
  if (t.device < -1) return InvalidArgument(who() + ": invalid device " + std::to_string(t.device));
  if (t.device >= 0) {
    int first = -1;
    if (!gpu_ordinal_.compare_exchange_strong(first, t.device) && first != t.device) {
      return InvalidArgument(who() + ": is on GPU " + std::to_string(t.device) + ", but this process already used GPU " +
                             std::to_string(first) + ": hvdlite works with one GPU per process (pin it with "
                             "torch.cuda.set_device(hvd.local_rank()))");
    }
  }
  if (t.op == HVDLITE_OP_ALLREDUCE || t.op == HVDLITE_OP_REDUCESCATTER) {
    if (!ValidReduceOp(t.reduce_op)) {
      return InvalidArgument(who() + ": unknown reduction op " + std::to_string(t.reduce_op));
    }
    if (t.dtype == HVDLITE_BOOL && t.reduce_op != HVDLITE_MIN && t.reduce_op != HVDLITE_MAX) {
      return InvalidArgument(who() + ": bool tensors support only Min and Max, not " +
                             ReduceOpName(t.reduce_op));
    }
    if (!std::isfinite(t.prescale_factor) || !std::isfinite(t.postscale_factor)) {
      return InvalidArgument(who() + ": scale factors must be finite");
    }
  }
  bool data_op = t.op != HVDLITE_OP_BARRIER && t.op != HVDLITE_OP_JOIN;
  if (data_op && elems > 0 && !t.input) return InvalidArgument(who() + ": input pointer is NULL");
  bool caller_output = t.op == HVDLITE_OP_ALLREDUCE || t.op == HVDLITE_OP_BROADCAST ||
                       t.op == HVDLITE_OP_REDUCESCATTER;
  if (caller_output && elems > 0 && !t.output) {
    return InvalidArgument(who() + ": " + op + " needs an output buffer");
  }
  if ((t.op == HVDLITE_OP_ALLGATHER || t.op == HVDLITE_OP_ALLTOALL ||
       t.op == HVDLITE_OP_REDUCESCATTER) && t.ndim < 1) {
    return InvalidArgument(who() + ": " + op + " needs a tensor with at least one dimension, got a 0-d one");
  }
  const int size = set.size();
  if (t.op == HVDLITE_OP_BROADCAST && (t.root_rank < 0 || t.root_rank >= topo_.size)) {
    return InvalidArgument(who() + ": root rank " + std::to_string(t.root_rank) +
                           " is out of range for " + std::to_string(topo_.size) + " ranks");
  }
  if (t.op == HVDLITE_OP_BROADCAST && set.SetRank(t.root_rank) < 0) {
    return InvalidArgument(who() + ": root rank " + std::to_string(t.root_rank) +
                           " is not a member of " + set.Describe());
  }
  if (t.op == HVDLITE_OP_ALLTOALL) {
    if (t.splits) {
      int64_t sum = 0;
      for (int r = 0; r < size; ++r) {
        if (t.splits[r] < 0) return InvalidArgument(who() + ": alltoall splits must not be negative");
        sum += t.splits[r];
      }
      if (sum != t.shape[0]) {
        return InvalidArgument(who() + ": alltoall splits sum to " + std::to_string(sum) +
                               " but the first dimension is " + std::to_string(t.shape[0]));
      }
    } else if (t.shape[0] % size != 0) {
      return InvalidArgument(who() + ": " + std::to_string(t.shape[0]) +
                             " rows cannot be split evenly across " + std::to_string(size) +
                             " ranks" + set.Where() + "; pass splits");
    }
  }
  return Status::OK();
}

Status Core::Enqueue(const hvdlite_tensor_t* tensors, int32_t n, bool group, hvdlite_handle_t* out) {
  if (loop_cpu_.load(std::memory_order_relaxed) >= 0) PlaceLoop(-1);
  return Submit(tensors, n, group, false, out);
}

void Core::PlaceLoop(int cpu) {
  std::lock_guard<std::mutex> lock(place_mutex_);
  if (loop_cpu_.load() == cpu || loop_tid_ == 0) return;
  if (PlaceThread(loop_tid_, cpu)) loop_cpu_.store(cpu);
}

Status Core::EnqueueAndWait(const hvdlite_tensor_t* tensor, double timeout_s, bool release,
                            hvdlite_handle_t* out, Status* op_status) {
  handles_.Announce();
  // A small host tensor's cycle may be this thread's (RunCallerCycle) if no other cycle
  // runs.
  std::unique_lock<std::timed_mutex> token;
  const int64_t bytes = config_.caller_cycle ? HostTensorBytes(tensor) : -1;
  if (bytes >= 0) {
    token = std::unique_lock<std::timed_mutex>(cycle_mutex_, std::try_to_lock);
    if (token.owns_lock()) {
      const int64_t most = CallerCycleBytes();  // 0: none at all, an empty op included
      if (most <= 0 || bytes > most) token.unlock();
    }
  }
  // Otherwise the background thread is woken on this thread's core, which this thread
  // leaves for it (see PlaceThread).
  if (!token.owns_lock() && follow_caller_.load(std::memory_order_relaxed)) {
    const int cpu = tensor && tensor->device < 0 ? sched_getcpu() : -1;
    if (cpu != loop_cpu_.load(std::memory_order_relaxed)) PlaceLoop(cpu);
  }
  Status s = Submit(tensor, 1, false, false, out, !token.owns_lock());
  if (!s.ok()) {
    handles_.Unannounce();
    return s;
  }
  if (token.owns_lock()) {
    RunCallerCycle(&token, *out,
                   queue_.PopAlone(tensor->op == HVDLITE_OP_JOIN ? kJoinName : tensor->name, &fresh_));
  }
  *op_status = handles_.Wait(*out, timeout_s, release, true);
  return Status::OK();
}

Status Core::Wait(hvdlite_handle_t h, double timeout_s, bool release) {
  bool announced = false;
  if (config_.caller_cycle && timeout_s != 0) {
    std::unique_lock<std::timed_mutex> token(cycle_mutex_, std::try_to_lock);
    const int64_t most = token.owns_lock() ? CallerCycleBytes() : 0;
    if (most > 0 && queue_.PopOnly(h, most, &fresh_)) {
      handles_.Announce();  // a caller blocked on its result from now, as EnqueueAndWait's
      announced = true;
      RunCallerCycle(&token, h, true);
    }
  }
  return handles_.Wait(h, timeout_s, release, announced);
}

Status Core::ProcessSet(int32_t id, std::shared_ptr<const ProcessSetMembers>* out) const {
  *out = sets_.Members(id);
  if (*out) return Status::OK();
  return InvalidArgument("process set " + std::to_string(id) +
                         " does not exist (add it with add_process_set first)");
}

Status Core::Submit(const hvdlite_tensor_t* tensors, int32_t n, bool group, bool table_change,
                    hvdlite_handle_t* out, bool wake) {
  Status s = CheckRunning();
  if (!s.ok()) return s;
  if (loop_ended_) {
    std::lock_guard<std::mutex> lock(end_mutex_);
    return end_status_;
  }
  if (n <= 0 || !tensors || !out) return InvalidArgument("no tensors given");
  std::vector<TensorEntry> entries;
  entries.reserve(n);
  std::string group_name = group ? "group:" + std::string(tensors[0].name ? tensors[0].name : "") +
                                       ":" + std::to_string(n)
                                 : "";
  auto now = Clock::now();
  std::shared_ptr<const ProcessSetMembers> set;
  for (int32_t i = 0; i < n; ++i) {
    const hvdlite_tensor_t& t = tensors[i];
    if (!set || set->id != t.process_set_id) {
      s = ProcessSet(t.process_set_id, &set);
      if (!s.ok()) return InvalidArgument(std::string("tensor '") + (t.name ? t.name : "") + "': " + s.message());
      if (!set->included()) {
        return InvalidArgument(std::string("tensor '") + (t.name ? t.name : "") + "': rank " +
                               std::to_string(topo_.rank) + " is not a member of " + set->Describe());
      }
    }
    if (group && t.process_set_id != tensors[0].process_set_id) {
      return InvalidArgument("grouped ops must all be in one process set");
    }
    s = Validate(t, i, *set);
    if (!s.ok()) return s;
    if ((t.op >= HVDLITE_OP_ADD_PROCESS_SET) != table_change) {
      return InvalidArgument(std::string("tensor '") + t.name + "': " + OpName(t.op) +
                             " cannot be enqueued (hvdlite_add_process_set makes it)");
    }
    if (group && (t.op != tensors[0].op || (t.op != HVDLITE_OP_ALLREDUCE && t.op != HVDLITE_OP_ALLGATHER &&
                                             t.op != HVDLITE_OP_REDUCESCATTER))) {
      return InvalidArgument("grouped ops must all be allreduces, all allgathers or all reducescatters");
    }
    TensorEntry e;
    Request& q = e.request;
    q.rank = set->rank;
    q.name = t.op == HVDLITE_OP_JOIN ? kJoinName : t.name;
    q.op = t.op;
    q.dtype = t.dtype;
    q.shape.assign(t.shape, t.shape + t.ndim);
    q.reduce_op = t.reduce_op;
    q.prescale = t.prescale_factor;
    q.postscale = t.postscale_factor;
    q.root_rank = t.op == HVDLITE_OP_BROADCAST ? set->SetRank(t.root_rank) : t.root_rank;
    if (t.op == HVDLITE_OP_ALLTOALL) {
      if (t.splits) {
        q.splits.assign(t.splits, t.splits + set->size());
      } else {
        q.splits.assign(set->size(), t.shape[0] / set->size());
      }
    }
    q.process_set = t.process_set_id;
    q.device = t.device;
    q.group = group_name;
    q.group_size = group ? n : 0;
    e.input = t.input;
    e.output = t.output;
    e.ready_event = t.device >= 0 ? t.ready_event : nullptr;
    e.enqueued = now;
    entries.push_back(std::move(e));
  }
  std::vector<hvdlite_handle_t> created;
  for (auto& e : entries) {
    e.handle = handles_.Create();
    created.push_back(e.handle);
  }
  s = queue_.Add(std::move(entries), wake);
  if (!s.ok()) {
    for (auto h : created) {
      handles_.Complete(h, s);
      handles_.Release(h);
    }
    return s;
  }
  for (int32_t i = 0; i < n; ++i) out[i] = created[i];
  // The loop may have ended between the check above and Add: never leave a handle
  // that nobody will complete.
  if (loop_ended_) {
    std::lock_guard<std::mutex> lock(end_mutex_);
    FailEverything(end_status_);
  }
  return Status::OK();
}

}  // namespace hvdlite
