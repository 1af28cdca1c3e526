#include "cycle/process_set.h"

#include <algorithm>

#include "common/thread_sched.h"

namespace hvdlite {

LayerSettings LayersOf(const Config& config) {
  return LayerSettings{config.host_id, config.hierarchical_allreduce, config.shm_allreduce,
                       config.hierarchical_allgather, config.hierarchical_broadcast};
}

ProcessSetMembers::ProcessSetMembers(int32_t id_, std::vector<int> ranks_, int global_rank)
    : id(id_), ranks(std::move(ranks_)), rank(-1) {
  rank = SetRank(global_rank);
}

int ProcessSetMembers::SetRank(int global_rank) const {
  auto it = std::lower_bound(ranks.begin(), ranks.end(), global_rank);
  return it != ranks.end() && *it == global_rank ? static_cast<int>(it - ranks.begin()) : -1;
}

std::string ProcessSetMembers::Describe() const {
  std::string list;
  for (size_t i = 0; i < ranks.size(); ++i) list += (i ? ", " : "") + std::to_string(ranks[i]);
  return "process set " + std::to_string(id) + " (" + (ranks.size() == 1 ? "rank " : "ranks ") +
         list + ")";
}

std::string ProcessSetMembers::Where() const { return id == 0 ? "" : " in " + Describe(); }

ProcessSetState::ProcessSetState(std::shared_ptr<const ProcessSetMembers> members,
                                 std::unique_ptr<MpiBackend> mpi, CoreParts parts)
    : members_(std::move(members)),
      rank_(members_->rank),
      size_(members_->size()),
      config_(parts.config),
      queue_(parts.queue),
      handles_(parts.handles),
      counters_(parts.counters),
      timeline_(parts.timeline),
      sets_(parts.sets),
      autotune_(parts.autotune),
      gpu_(parts.gpu),
      end_loop_(std::move(parts.end_loop)),
      mpi_(std::move(mpi)) {
  if (!included()) return;
  cache_.reset(config_.cache_capacity > 0 ? new ResponseCache(config_.cache_capacity) : nullptr);
  std::vector<int> ranks = members_->id == 0 ? std::vector<int>() : members_->ranks;
  controller_.reset(rank_ == 0 ? new Controller(size_, config_, ranks, members_->Where()) : nullptr);
}

void ProcessSetState::FailInFlight(const Status& s) {
  for (const auto& taken : queue_.TakeSet(id())) {
    counters_.errors++;
    handles_.Complete(taken.first, Status(s.code(), s.message() + " (tensor '" + taken.second + "')"));
  }
  fresh_.clear();
}

// Runs on every rank of the set that carries the change (set 0: all ranks), at the same
// point of the response order: MPI_Comm_split over that set's communicator.
Status ProcessSetState::AddSet(const Response& r, OpOutput* out) {
  // Creating communicators and windows waits in MPI, which spins, for the set's ranks.
  NormalPriorityScope normal;
  std::vector<int> ranks(r.shape.begin(), r.shape.end());
  const int me = members_->ranks[rank_];
  auto members = std::make_shared<const ProcessSetMembers>(sets_.FreeId(), ranks, me);
  std::unique_ptr<MpiBackend> mpi(new MpiBackend());
  Status s = mpi->InitSubset(*mpi_, members->included(), LayersOf(config_));
  if (!s.ok()) return s;
  out->first_dim = members->id;
  HVDLITE_LOG(DEBUG) << "added " << members->Describe();
  sets_.Insert(std::unique_ptr<ProcessSetState>(new ProcessSetState(
      members, std::move(mpi),
      CoreParts{config_, queue_, handles_, counters_, timeline_, sets_, autotune_, gpu_, end_loop_})));
  return Status::OK();
}

Status ProcessSetState::RemoveSet(const Response& r) {
  std::unique_ptr<ProcessSetState> gone = sets_.Take(static_cast<int32_t>(r.shape.at(0)));
  if (!gone) return Status::OK();  // checked at enqueue on every rank
  NormalPriorityScope normal;  // freeing them, too
  gone->FailInFlight(Status(HVDLITE_ERR_INVALID_ARGUMENT,
                            gone->members()->Describe() + " was removed while this op was in flight"));
  if (gone->included()) gone->Close(true);
  HVDLITE_LOG(DEBUG) << "removed " << gone->members()->Describe();
  return Status::OK();
}

std::shared_ptr<const ProcessSetMembers> ProcessSetTable::Members(int32_t id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sets_.find(id);
  return it == sets_.end() ? nullptr : it->second->members();
}

std::vector<std::shared_ptr<const ProcessSetMembers>> ProcessSetTable::All() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<const ProcessSetMembers>> all;
  for (const auto& kv : sets_) all.push_back(kv.second->members());
  return all;
}

int32_t ProcessSetTable::IdOf(const std::vector<int>& ranks) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& kv : sets_) {
    if (kv.second->members()->ranks == ranks) return kv.first;
  }
  return -1;
}

ProcessSetState* ProcessSetTable::Find(int32_t id) const {
  auto it = sets_.find(id);
  return it == sets_.end() ? nullptr : it->second.get();
}

ProcessSetState* ProcessSetTable::NextMember(int32_t id) const {
  for (auto it = sets_.upper_bound(id); it != sets_.end(); ++it) {
    if (it->second->included()) return it->second.get();
  }
  return nullptr;
}

int32_t ProcessSetTable::FreeId() const {
  int32_t id = 0;
  for (const auto& kv : sets_) {
    if (kv.first != id) break;
    ++id;
  }
  return id;
}

void ProcessSetTable::Insert(std::unique_ptr<ProcessSetState> set) {
  std::lock_guard<std::mutex> lock(mutex_);
  int32_t id = set->id();
  sets_[id] = std::move(set);
}

std::unique_ptr<ProcessSetState> ProcessSetTable::Take(int32_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sets_.find(id);
  if (it == sets_.end()) return nullptr;
  std::unique_ptr<ProcessSetState> set = std::move(it->second);
  sets_.erase(it);
  return set;
}

void ProcessSetTable::Clear(bool transport_ok) {
  std::map<int32_t, std::unique_ptr<ProcessSetState>> sets;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    sets.swap(sets_);
  }
  for (auto it = sets.rbegin(); it != sets.rend(); ++it) {
    if (it->second->included()) it->second->Close(transport_ok);
  }
}

}  // namespace hvdlite
