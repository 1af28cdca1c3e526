#include "cycle/controller.h"

#include <algorithm>
#include <functional>

namespace hvdlite {
namespace {

std::string Num(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

}  // namespace

void Controller::AddRequest(const Request& q, Clock::time_point now) {
  if (q.rank < 0 || q.rank >= size_) return;
  if (!q.refusal.empty()) return AddRefusal(q);
  if (!refused_.empty() && AnswerRefused(q)) return;
  if (q.op == HVDLITE_OP_JOIN && q.name == kLeaveJoinName) {
    if (joined_[q.rank]) {  // the rank left its join: a full rank again
      joined_[q.rank] = 0;
      --joined_count_;
    }
    return;
  }
  if (q.op == HVDLITE_OP_JOIN) {
    if (!joined_[q.rank]) {
      joined_[q.rank] = 1;
      ++joined_count_;
    }
    last_joined_ = q.rank;
    return;
  }
  auto it = table_.find(q.name);
  if (it == table_.end()) {
    PendingTensor p;
    p.requests.resize(size_);
    p.have.assign(size_, 0);
    p.seq = seq_++;
    p.first_seen = now - std::chrono::milliseconds(q.wait_ms);
    p.last_warning = p.first_seen;
    order_[p.seq] = q.name;
    it = table_.emplace(q.name, std::move(p)).first;
  }
  PendingTensor& p = it->second;
  auto seen = now - std::chrono::milliseconds(q.wait_ms);
  if (seen < p.first_seen) p.first_seen = seen;
  p.requests[q.rank] = q;
  p.have[q.rank] = 1;
}

Response Controller::RefusalError(const std::string& name, int32_t op,
                                  const std::string& error) const {
  Response r;
  r.op = op;
  r.name = name;
  r.error_code = HVDLITE_ERR_ABORTED;
  r.error = error;
  r.targets.assign(size_, 0);
  return r;
}

void Controller::AddRefusal(const Request& q) {
  auto known = refused_.find(q.name);
  if (known != refused_.end()) {  // refused by another rank too: nothing owed to this one
    known->second.owed[q.rank] = 0;
    if (std::find(known->second.owed.begin(), known->second.owed.end(), 1) == known->second.owed.end()) {
      refused_.erase(known);
    }
    return;
  }
  Refused f;
  f.error = "rank " + std::to_string(Global(q.rank)) + " refused the " + OpName(q.op) + " of tensor '" +
            q.name + "'" + where_ + " that other ranks submitted: " + q.refusal;
  f.owed.assign(size_, 1);
  f.owed[q.rank] = 0;
  for (int r = 0; r < size_; ++r) {
    if (joined_[r]) f.owed[r] = 0;  // a joined rank submits nothing more
  }
  Response now = RefusalError(q.name, q.op, f.error);
  bool any_now = false;
  auto it = table_.find(q.name);
  if (it != table_.end()) {
    for (int r = 0; r < size_; ++r) {
      if (it->second.have[r]) {
        now.targets[r] = 1;
        f.owed[r] = 0;
        any_now = true;
      }
    }
    order_.erase(it->second.seq);
    table_.erase(it);
  }
  if (any_now) refusal_errors_.push_back(now);
  if (std::find(f.owed.begin(), f.owed.end(), 1) != f.owed.end()) refused_[q.name] = std::move(f);
}

bool Controller::AnswerRefused(const Request& q) {
  auto known = refused_.find(q.name);
  if (known == refused_.end() || !known->second.owed[q.rank]) return false;
  Response late = RefusalError(q.name, q.op, known->second.error);
  late.targets[q.rank] = 1;
  refusal_errors_.push_back(late);
  known->second.owed[q.rank] = 0;
  if (std::find(known->second.owed.begin(), known->second.owed.end(), 1) == known->second.owed.end()) {
    refused_.erase(known);
  }
  return true;
}

bool Controller::Ready(const PendingTensor& p) const {
  bool any = false;
  for (int r = 0; r < size_; ++r) {
    if (p.have[r]) {
      any = true;
    } else if (!joined_[r]) {
      return false;
    }
  }
  return any;
}

std::string Controller::Ranks(const std::vector<int>& set_ranks) const {
  if (ranks_.empty()) return RankList(set_ranks);
  std::vector<int> global;
  for (int r : set_ranks) global.push_back(ranks_[r]);
  return RankList(global);
}

std::string Controller::MissingRanks(const PendingTensor& p) const {
  std::vector<int> missing;
  for (int r = 0; r < size_; ++r) {
    if (!p.have[r] && !joined_[r]) missing.push_back(r);
  }
  return Ranks(missing);
}

// Checks one property across the ranks that submitted; on disagreement returns a
// message listing which ranks had which value.
static bool Agree(const std::vector<Request>& reqs, const std::vector<uint8_t>& have,
                  const std::vector<int>& ranks,
                  const std::function<std::string(const Request&)>& value, std::string* diff) {
  std::vector<std::string> values(reqs.size());
  for (size_t r = 0; r < reqs.size(); ++r) {
    if (have[r]) values[r] = value(reqs[r]);
  }
  *diff = Disagreement(values, &have, ranks.empty() ? nullptr : &ranks);
  return diff->empty();
}

// Whether b asks what a does, as far as Mismatched looks (at least as strict: true means
// Mismatched finds nothing): the same op, dtype, memory, set, group, reduction, scale
// factors, root; the same shape, or for allgather and alltoall the same trailing
// dimensions (their first dimension and splits may differ); the GPU's ordinal may too.
static bool Agrees(const Request& a, const Request& b) {
  if (a.op != b.op || a.dtype != b.dtype || (a.device < 0) != (b.device < 0) || a.process_set != b.process_set ||
      a.group != b.group || a.reduce_op != b.reduce_op || !SameFactor(a.prescale, b.prescale) ||
      !SameFactor(a.postscale, b.postscale) || a.root_rank != b.root_rank) {
    return false;
  }
  if (a.op != HVDLITE_OP_ALLGATHER && a.op != HVDLITE_OP_ALLTOALL) return a.shape == b.shape;
  return !a.shape.empty() && !b.shape.empty() && a.shape.size() == b.shape.size() &&
         std::equal(a.shape.begin() + 1, a.shape.end(), b.shape.begin() + 1);
}

// The first property in which the ranks' requests differ, as a mismatch error in *out
// (true), or false where they differ only where they may (allgather's first dimension,
// alltoall's splits, the group size).
bool Controller::Mismatched(const std::string& name, const PendingTensor& p, const Request& base,
                            Response* out) const {
  auto fail = [&](const std::string& what, const std::string& diff) {
    out->error_code = HVDLITE_ERR_MISMATCH;
    out->error = std::string("Mismatched ") + what + " for " + OpName(base.op) + " of tensor '" +
                name + "'" + where_ + ": " + diff;
    out->cacheable = false;
    return true;
  };
  std::string diff;
  const auto& rq = p.requests;
  if (!Agree(rq, p.have, ranks_, [](const Request& q) { return std::string(OpName(q.op)); }, &diff)) {
    return fail("operations", diff);
  }
  if (!Agree(rq, p.have, ranks_, [](const Request& q) { return std::string(DtypeName(q.dtype)); }, &diff)) {
    return fail("data types", diff);
  }
  if (!Agree(rq, p.have, ranks_, [](const Request& q) { return std::string(q.device < 0 ? "host memory" : "GPU memory"); }, &diff)) {
    return fail("devices", diff);
  }
  if (!Agree(rq, p.have, ranks_, [](const Request& q) { return "process set " + std::to_string(q.process_set); }, &diff)) {
    return fail("process sets", diff);
  }
  if (!Agree(rq, p.have, ranks_, [](const Request& q) { return q.group.empty() ? std::string("no group") : "group '" + q.group + "'"; }, &diff)) {
    return fail("groups", diff);
  }
  const int op = base.op;
  if (op == HVDLITE_OP_ADD_PROCESS_SET || op == HVDLITE_OP_REMOVE_PROCESS_SET) {
    // shape carries the new set's ranks, or the id of the set to remove.
    const bool add = op == HVDLITE_OP_ADD_PROCESS_SET;
    auto what = [add](const Request& q) {
      return add ? "ranks " + ShapeString(q.shape) : "process set " + std::to_string(q.shape.empty() ? -1 : q.shape[0]);
    };
    if (!Agree(rq, p.have, ranks_, what, &diff)) {
      out->error_code = HVDLITE_ERR_MISMATCH;
      out->error = std::string("Mismatched ") + OpName(op) + " calls (change " + name + ")" + where_ +
                   ": every rank must make the same process-set changes in the same order; " + diff;
      return true;
    }
    return false;
  }
  if (op == HVDLITE_OP_ALLREDUCE || op == HVDLITE_OP_REDUCESCATTER) {
    if (!Agree(rq, p.have, ranks_, [](const Request& q) { return std::string(ReduceOpName(q.reduce_op)); }, &diff)) {
      return fail("reduction ops", diff);
    }
    if (!Agree(rq, p.have, ranks_, [](const Request& q) { return "prescale " + Num(q.prescale) + ", postscale " + Num(q.postscale); }, &diff)) {
      return fail("scale factors", diff);
    }
  }
  if (op == HVDLITE_OP_ALLREDUCE || op == HVDLITE_OP_BROADCAST || op == HVDLITE_OP_REDUCESCATTER) {
    if (!Agree(rq, p.have, ranks_, [](const Request& q) { return "shape " + ShapeString(q.shape); }, &diff)) {
      return fail("shapes", diff);
    }
  }
  if (op == HVDLITE_OP_ALLGATHER || op == HVDLITE_OP_ALLTOALL) {
    auto tail = [](const Request& q) {
      if (q.shape.empty()) return std::string("a 0-d tensor");
      std::vector<int64_t> t(q.shape.begin() + 1, q.shape.end());
      return "trailing dims " + ShapeString(t);
    };
    if (!Agree(rq, p.have, ranks_, tail, &diff)) return fail("trailing dimensions", diff);
  }
  if (op == HVDLITE_OP_BROADCAST) {
    if (!Agree(rq, p.have, ranks_, [this](const Request& q) { return "root rank " + std::to_string(Global(q.root_rank)); }, &diff)) {
      return fail("root ranks", diff);
    }
  }
  return false;
}

Response Controller::Validate(const std::string& name, const PendingTensor& p) const {
  int base_rank = 0;
  while (!p.have[base_rank]) ++base_rank;
  const Request& base = p.requests[base_rank];
  Response out;
  out.op = base.op;
  out.name = name;
  out.dtype = base.dtype;
  out.on_device = base.device >= 0;
  out.shape = base.shape;
  out.reduce_op = base.reduce_op;
  out.prescale = base.prescale;
  out.postscale = base.postscale;
  out.root_rank = base.root_rank;
  out.group = base.group;
  // As in Horovod, Average divides by every rank, joined ones (which add zeros) too.
  out.contributors = size_;
  out.joined = joined_;

  // Nearly always every rank sent the same parameters, which one comparison of the
  // requests shows; only when some differ are they compared property by property (with
  // strings), to say which differed. A cycle of 200 tensors paid ~1 ms for those strings.
  bool same = true;
  for (int r = 0; r < size_ && same; ++r) same = !p.have[r] || Agrees(p.requests[r], base);
  if (!same && Mismatched(name, p, base, &out)) return out;
  const int op = base.op;
  if (op == HVDLITE_OP_ADD_PROCESS_SET || op == HVDLITE_OP_REMOVE_PROCESS_SET) return out;  // never cached
  if ((op == HVDLITE_OP_ALLGATHER || op == HVDLITE_OP_ALLTOALL) && base.shape.empty()) {
    out.error_code = HVDLITE_ERR_INVALID_ARGUMENT;
    out.error = std::string(OpName(op)) + " of tensor '" + name + "' needs at least one dimension";
    return out;
  }
  if (op == HVDLITE_OP_BROADCAST && (base.root_rank < 0 || base.root_rank >= size_)) {
    out.error_code = HVDLITE_ERR_INVALID_ARGUMENT;
    out.error = "broadcast of tensor '" + name + "': root rank " + std::to_string(base.root_rank) +
                " is out of range for " + std::to_string(size_) + " ranks";
    return out;
  }
  const auto& rq = p.requests;
  if (joined_count_ > 0 && op != HVDLITE_OP_ALLREDUCE) {
    // Horovod's rule: joined ranks take part in allreduces only (with zeros).
    std::vector<int> joined;
    for (int r = 0; r < size_; ++r) {
      if (joined_[r]) joined.push_back(r);
    }
    out.error_code = HVDLITE_ERR_ABORTED;
    out.error = std::string(OpName(op)) + " of tensor '" + name + "'" + where_ + " is not supported while " +
                Ranks(joined) + (joined.size() == 1 ? " has" : " have") +
                " joined; only allreduce is";
    return out;
  }
  if (op == HVDLITE_OP_ALLGATHER) {
    out.first_dims.assign(size_, 0);
    for (int r = 0; r < size_; ++r) out.first_dims[r] = p.have[r] ? rq[r].shape[0] : 0;
  }
  if (op == HVDLITE_OP_ALLTOALL) {
    out.splits.assign(static_cast<size_t>(size_) * size_, 0);
    for (int r = 0; r < size_; ++r) {
      const auto& s = rq[r].splits;
      if (static_cast<int>(s.size()) != size_) {
        out.error_code = HVDLITE_ERR_INVALID_ARGUMENT;
        out.error = "alltoall of tensor '" + name + "': rank " + std::to_string(r) + " gave " +
                    std::to_string(s.size()) + " splits for " + std::to_string(size_) + " ranks";
        return out;
      }
      std::copy(s.begin(), s.end(), out.splits.begin() + static_cast<size_t>(r) * size_);
    }
  }
  out.cacheable = joined_count_ == 0 && base.group.empty();
  return out;
}

void Controller::CheckStalls(Clock::time_point now, std::vector<Response>* out) {
  last_stall_check_ = now;
  std::vector<std::string> expired;
  for (auto& kv : order_) {
    PendingTensor& p = table_[kv.second];
    double age = std::chrono::duration<double>(now - p.first_seen).count();
    if (config_.stall_shutdown_s > 0 && age >= config_.stall_shutdown_s) {
      Response r;
      r.op = p.requests[0].op;
      for (int k = 0; k < size_; ++k) {
        if (p.have[k]) {
          r.op = p.requests[k].op;
          r.dtype = p.requests[k].dtype;
          break;
        }
      }
      r.name = kv.second;
      r.error_code = HVDLITE_ERR_STALLED;
      // A group member every rank submitted waits for the group's other members.
      r.error = std::string(OpName(r.op)) + " of tensor '" + kv.second + "'" + where_ + " stalled: " +
                (Ready(p) ? "it waited for the rest of its group, which was not submitted"
                          : MissingRanks(p) + " did not submit it") +
                " within " + Num(config_.stall_shutdown_s) + " s (HVDLITE_STALL_SHUTDOWN_TIME)";
      HVDLITE_LOG(ERROR) << r.error;
      out->push_back(r);
      expired.push_back(kv.second);
      continue;
    }
    double since_warning = std::chrono::duration<double>(now - p.last_warning).count();
    if (config_.stall_check_s > 0 && age >= config_.stall_check_s &&
        (!p.warned || since_warning >= config_.stall_check_s)) {
      p.warned = true;
      p.last_warning = now;
      std::vector<int> ready;
      for (int r = 0; r < size_; ++r) if (p.have[r]) ready.push_back(r);
      HVDLITE_LOG(WARNING) << "stall: " << OpName(p.requests[ready.empty() ? 0 : ready[0]].op)
                           << " of tensor '" << kv.second << "'" << where_ << " has waited " << Num(age)
                           << " s; submitted by " << Ranks(ready) << ", missing on "
                           << MissingRanks(p);
    }
  }
  for (const auto& name : expired) {
    order_.erase(table_[name].seq);
    table_.erase(name);
  }
}

bool Controller::WantsRound(Clock::time_point now) const {
  if (table_.empty() || (config_.stall_check_s <= 0 && config_.stall_shutdown_s <= 0)) {
    return false;  // nothing pending, or stall checks are off
  }
  double check = config_.stall_check_s > 0 ? config_.stall_check_s : 1e300;
  if (config_.stall_shutdown_s > 0) check = std::min(check, config_.stall_shutdown_s);
  double interval = std::min(1.0, check / 4);
  return std::chrono::duration<double>(now - last_stall_check_).count() >= interval;
}

std::vector<Response> Controller::BuildResponses(Clock::time_point now) {
  std::vector<Response> out;
  out.swap(refusal_errors_);
  // Groups complete only when every member is ready; members keep arrival order.
  std::unordered_map<std::string, std::vector<std::string>> ready_groups;
  std::vector<std::string> done;
  // Groups that ranks disagree on (e.g. different numbers of members) can never
  // complete: their members fail now, together with the members still pending.
  std::unordered_map<std::string, std::string> failed_groups;  // group -> error
  for (auto& kv : order_) {
    const PendingTensor& p = table_[kv.second];
    if (!Ready(p)) continue;
    int base_rank = 0;
    while (!p.have[base_rank]) ++base_rank;
    const Request& base = p.requests[base_rank];
    bool same_group = true;
    for (int r = 0; r < size_; ++r) {
      if (p.have[r] && (p.requests[r].group != base.group ||
                        p.requests[r].group_size != base.group_size)) {
        same_group = false;
      }
    }
    if (!same_group) {
      Response bad = Validate(kv.second, p);
      if (bad.error.empty()) {
        bad.error_code = HVDLITE_ERR_MISMATCH;
        bad.error = "Mismatched groups for tensor '" + kv.second + "'";
        bad.cacheable = false;
      }
      for (int r = 0; r < size_; ++r) {
        if (p.have[r] && !p.requests[r].group.empty()) {
          failed_groups.emplace(p.requests[r].group, bad.error);
        }
      }
      out.push_back(bad);
      done.push_back(kv.second);
      continue;
    }
    if (!base.group.empty()) {
      auto& members = ready_groups[base.group];
      members.push_back(kv.second);
      if (static_cast<int>(members.size()) < base.group_size) continue;
      for (const auto& m : members) {
        out.push_back(Validate(m, table_[m]));
        done.push_back(m);
      }
      continue;
    }
    out.push_back(Validate(kv.second, p));
    done.push_back(kv.second);
  }
  if (!failed_groups.empty()) {
    for (auto& kv : order_) {
      if (std::find(done.begin(), done.end(), kv.second) != done.end()) continue;
      const PendingTensor& p = table_[kv.second];
      for (int r = 0; r < size_; ++r) {
        auto g = p.have[r] ? failed_groups.find(p.requests[r].group) : failed_groups.end();
        if (g == failed_groups.end()) continue;
        Response bad;
        bad.op = p.requests[r].op;
        bad.name = kv.second;
        bad.dtype = p.requests[r].dtype;
        bad.group = g->first;
        bad.error_code = HVDLITE_ERR_MISMATCH;
        bad.error = g->second;
        bad.cacheable = false;
        out.push_back(bad);
        done.push_back(kv.second);
        break;
      }
    }
  }
  for (const auto& name : done) {
    order_.erase(table_[name].seq);
    table_.erase(name);
  }
  // A group is all-or-nothing: if any member failed validation, fail all of them (with
  // the first failure's error; looked up by group, not member against member).
  std::unordered_map<std::string, const Response*> group_failures;
  for (const auto& r : out) {
    if (!r.group.empty() && !r.error.empty()) group_failures.emplace(r.group, &r);
  }
  for (auto& r : out) {
    if (group_failures.empty()) break;
    auto failed = r.group.empty() || !r.error.empty() ? group_failures.end() : group_failures.find(r.group);
    if (failed == group_failures.end()) continue;
    r.error = failed->second->error;
    r.error_code = failed->second->error_code;
  }
  if (joined_count_ == size_) {
    Response j;
    j.op = HVDLITE_OP_JOIN;
    j.name = "join";
    j.last_joined_rank = Global(last_joined_);
    j.contributors = 0;
    out.push_back(j);
    std::fill(joined_.begin(), joined_.end(), 0);
    joined_count_ = 0;
  }
  if (WantsRound(now)) CheckStalls(now, &out);
  return out;
}

}  // namespace hvdlite
