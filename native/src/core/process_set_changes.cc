// The calls that change the process-set table (collective over every rank: each is an
// op of the global set, negotiated and run like any other) and refusals (an op this
// rank will not submit, told to its set's coordinator). Framework threads.
#include "core/core.h"

#include <algorithm>
#include <cstring>

namespace hvdlite {

Status Core::AddProcessSet(const int32_t* ranks, int32_t n, int32_t* id) {
  Status s = CheckRunning();
  if (!s.ok()) return s;
  if (!ranks || n <= 0) return InvalidArgument("a process set needs at least one rank");
  std::vector<int> sorted(ranks, ranks + n);
  std::sort(sorted.begin(), sorted.end());
  std::string given = ShapeString(std::vector<int64_t>(ranks, ranks + n));
  for (int32_t i = 0; i < n; ++i) {
    if (sorted[i] < 0 || sorted[i] >= topo_.size) {
      return InvalidArgument("process set ranks " + given + ": rank " + std::to_string(sorted[i]) +
                             " is out of range for " + std::to_string(topo_.size) + " ranks");
    }
    if (i > 0 && sorted[i] == sorted[i - 1]) {
      return InvalidArgument("process set ranks " + given + ": rank " + std::to_string(sorted[i]) +
                             " is given twice");
    }
  }
  std::lock_guard<std::mutex> lock(change_mutex_);
  // Every rank holds the same table, so every rank refuses alike.
  int32_t existing = sets_.IdOf(sorted);
  if (existing >= 0) {
    return InvalidArgument("process set ranks " + given + ": " +
                           sets_.Members(existing)->Describe() + " already has these ranks");
  }
  int64_t result = -1;
  s = ChangeTable(HVDLITE_OP_ADD_PROCESS_SET, std::vector<int64_t>(sorted.begin(), sorted.end()), &result);
  if (s.ok()) *id = static_cast<int32_t>(result);
  return s;
}

Status Core::RemoveProcessSet(int32_t id) {
  Status s = CheckRunning();
  if (!s.ok()) return s;
  if (id == 0) return InvalidArgument("the global process set (0) cannot be removed");
  std::lock_guard<std::mutex> lock(change_mutex_);
  std::shared_ptr<const ProcessSetMembers> set;
  s = ProcessSet(id, &set);
  if (!s.ok()) return s;
  int64_t unused = 0;
  return ChangeTable(HVDLITE_OP_REMOVE_PROCESS_SET, {id}, &unused);
}

// change_mutex_ held. A change is an op of the global set, named by its place in this
// process's sequence of changes: so the k-th change of every rank negotiates with the
// k-th change of the others, and ranks that disagree learn it as a mismatch.
Status Core::ChangeTable(int32_t op, const std::vector<int64_t>& argument, int64_t* result) {
  const uint8_t unused = 0;
  std::string name = "process_set_change." + std::to_string(changes_);
  hvdlite_tensor_t t = {};
  t.name = name.c_str();
  t.op = op;
  t.dtype = HVDLITE_UINT8;
  t.ndim = static_cast<int32_t>(argument.size());
  t.shape = argument.data();
  t.input = &unused;
  t.process_set_id = 0;
  t.device = -1;
  hvdlite_handle_t h = 0;
  Status s = Submit(&t, 1, false, true, &h);
  if (!s.ok()) return s;
  ++changes_;
  s = handles_.Wait(h, -1);
  if (s.ok()) {
    void* data = nullptr;
    int64_t nbytes = 0;
    s = handles_.Output(h, &data, &nbytes, result);
  }
  handles_.Release(h);
  return s;
}

Status Core::LeaveJoin() {
  Status s = CheckRunning();
  if (!s.ok()) return s;
  Request q;
  q.rank = topo_.rank;
  q.name = kLeaveJoinName;
  q.op = HVDLITE_OP_JOIN;
  q.dtype = HVDLITE_UINT8;
  q.process_set = 0;
  {
    std::lock_guard<std::mutex> lock(refusals_mutex_);
    refusals_.push_back(std::move(q));
  }
  queue_.Wake();
  return Status::OK();
}

Status Core::Refuse(int32_t op, const char* name, int32_t process_set, const std::string& reason) {
  Status s = CheckRunning();
  if (!s.ok()) return s;
  if (!name || !*name || std::strlen(name) > kMaxNameBytes) return InvalidArgument("refuse: a valid name is required");
  if (!ValidOp(op) || op == HVDLITE_OP_JOIN || op >= HVDLITE_OP_ADD_PROCESS_SET) {
    return InvalidArgument("refuse: unknown op " + std::to_string(op));
  }
  std::shared_ptr<const ProcessSetMembers> set;
  s = ProcessSet(process_set, &set);
  if (!s.ok()) return InvalidArgument(std::string("refusal of tensor '") + name + "': " + s.message());
  if (!set->included()) {
    return InvalidArgument(std::string("refusal of tensor '") + name + "': rank " +
                           std::to_string(topo_.rank) + " is not a member of " + set->Describe());
  }
  Request q;
  q.rank = set->rank;
  q.name = name;
  q.op = op;
  q.dtype = HVDLITE_UINT8;
  q.process_set = process_set;
  q.refusal = reason.empty() ? std::string("refused at the call") : reason.substr(0, kMaxNameBytes);
  {
    std::lock_guard<std::mutex> lock(refusals_mutex_);
    refusals_.push_back(std::move(q));
  }
  queue_.Wake();
  return Status::OK();
}

}  // namespace hvdlite
