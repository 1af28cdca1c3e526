#include "backend/backend_mpi.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "common/elementwise.h"
#include "common/mpi_glue.h"
#include "transport/mpi_fault_guard.h"
#include "common/poll_backoff.h"
#include "common/thread_sched.h"

namespace hvdlite {
namespace {

// MPI lives as long as the process, not as one run of the core: hvdlite.init() may follow
// hvdlite.shutdown(), as it may in Horovod, and MPI cannot start again once finalized.
// So a clean shutdown of a run that started MPI leaves MPI_Finalize to the process's
// exit. A shutdown after a failure does not (peers may be gone: MPI_Finalize could block),
// as before. Read and written by whichever thread starts or stops the core, one at a time.
bool g_started_mpi = false;
bool g_finalize_at_exit = false;

// The MPI shared-memory segments this process maps (/proc/self/maps): Open MPI's sm
// transport's (sm_segment.*; vader_segment.* before 5.0) and MPICH's. The launcher's
// cleanup of a job's segments knows the same names (MPI_SEGMENT_PREFIXES in
// hvdlite/runner/rank_wrapper.py): a new MPI's goes in both.
std::vector<std::string> MappedMpiSegments() {
  std::vector<std::string> found;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const size_t at = line.find("/dev/shm/");
    if (at == std::string::npos) continue;
    const std::string path = line.substr(at);
    const std::string name = path.substr(9);
    for (const char* prefix : {"sm_segment.", "vader_segment.", "mpich_shm_"}) {
      if (name.rfind(prefix, 0) == 0 && std::find(found.begin(), found.end(), path) == found.end()) {
        found.push_back(path);
      }
    }
  }
  return found;
}

void FinalizeMpiAtExit() {
  if (!g_finalize_at_exit) return;
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  // A world of one process (a script run without a launcher: an MPI singleton) owns its
  // segments alone, and Open MPI 5 leaves a singleton's 16 MiB sm segment in /dev/shm
  // after MPI_Finalize (no launcher daemon cleans up after it): it goes here.
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const std::vector<std::string> segments = world == 1 ? MappedMpiSegments() : std::vector<std::string>();
  MPI_Finalize();
  for (const std::string& path : segments) unlink(path.c_str());
}

// Elementwise reductions over 16-bit floats, which MPI has no type for: MPI's
// user-defined ops compute inout = in op inout, as ReduceHalfInto does.
template <int32_t kDtype, int32_t kOp>
void HalfReduce(void* in, void* inout, int* len, MPI_Datatype*) {
  ReduceHalfInto(static_cast<uint16_t*>(inout), static_cast<const uint16_t*>(in), *len, kDtype, kOp);
}

MPI_User_function* kHalfFns[2][5] = {
    {HalfReduce<HVDLITE_FLOAT16, HVDLITE_AVERAGE>, HalfReduce<HVDLITE_FLOAT16, HVDLITE_SUM>,
     HalfReduce<HVDLITE_FLOAT16, HVDLITE_MIN>, HalfReduce<HVDLITE_FLOAT16, HVDLITE_MAX>,
     HalfReduce<HVDLITE_FLOAT16, HVDLITE_PRODUCT>},
    {HalfReduce<HVDLITE_BFLOAT16, HVDLITE_AVERAGE>, HalfReduce<HVDLITE_BFLOAT16, HVDLITE_SUM>,
     HalfReduce<HVDLITE_BFLOAT16, HVDLITE_MIN>, HalfReduce<HVDLITE_BFLOAT16, HVDLITE_MAX>,
     HalfReduce<HVDLITE_BFLOAT16, HVDLITE_PRODUCT>}};

MPI_Datatype MpiType(int32_t dtype) {
  switch (dtype) {
    case HVDLITE_UINT8: case HVDLITE_BOOL: return MPI_UINT8_T;
    case HVDLITE_INT8: return MPI_INT8_T;
    case HVDLITE_INT16: return MPI_INT16_T;
    case HVDLITE_UINT16: return MPI_UINT16_T;
    case HVDLITE_INT32: return MPI_INT32_T;
    case HVDLITE_INT64: return MPI_INT64_T;
    case HVDLITE_FLOAT16: case HVDLITE_BFLOAT16: return MPI_UINT16_T;
    case HVDLITE_FLOAT32: return MPI_FLOAT;
    default: return MPI_DOUBLE;
  }
}

MPI_Op StandardOp(int32_t reduce_op) {
  switch (reduce_op) {
    case HVDLITE_MIN: return MPI_MIN;
    case HVDLITE_MAX: return MPI_MAX;
    case HVDLITE_PRODUCT: return MPI_PROD;
    default: return MPI_SUM;
  }
}

// MPI counts are int: large buffers go in chunks of at most this many elements.
constexpr int64_t kMaxChunk = 1 << 30;

// Where each rank's part starts in the whole, and the whole's length last.
std::vector<int64_t> Bounds(const std::vector<int64_t>& per_rank) {
  std::vector<int64_t> bounds(1, 0);
  for (int64_t n : per_rank) bounds.push_back(bounds.back() + n);
  return bounds;
}

}  // namespace

Status MpiBackend::Init(int64_t comm_f2c, bool thread_multiple, const LayerSettings& layers,
                        MpiTopology* topo) {
  InstallMpiFaultGuard();
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = 0;
  g_finalize_at_exit = false;  // until this run ends cleanly
  if (!initialized) {
    // The background thread makes every MPI call (HVDLITE_MPI_THREAD_FUNNELED asks for
    // no more; a later run's thread, after shutdown and init again, takes over).
    int required = thread_multiple ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED;
    int rc = MPI_Init_thread(nullptr, nullptr, required, &provided);
    if (rc != MPI_SUCCESS) return Check(rc, "MPI_Init_thread");
    g_started_mpi = true;
    std::atexit(FinalizeMpiAtExit);
  } else {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {
      return Status(HVDLITE_ERR_NOT_INITIALIZED,
                    "MPI was already finalized in this process; hvdlite cannot start again");
    }
    MPI_Query_thread(&provided);
  }
  if (initialized && provided < MPI_THREAD_SERIALIZED) {
    HVDLITE_LOG(WARNING) << "MPI provides thread level " << provided
                         << "; hvdlite calls MPI from its background thread, so another "
                            "thread must not call MPI concurrently";
  }
  threads_multiple_ = topo->threads_multiple = provided == MPI_THREAD_MULTIPLE;
  MPI_Comm base = comm_f2c < 0 ? MPI_COMM_WORLD : MPI_Comm_f2c(static_cast<MPI_Fint>(comm_f2c));
  comm_ = new MPI_Comm(MPI_COMM_NULL);
  Status s = Check(MPI_Comm_dup(base, &Comm(comm_)), "MPI_Comm_dup");
  if (!s.ok()) return s;
  // Failures come back as codes that become statuses instead of aborting the job.
  MPI_Comm_set_errhandler(Comm(comm_), MPI_ERRORS_RETURN);
  MPI_Comm_rank(Comm(comm_), &global_rank_);
  // Which ranks share this one's cores, from every rank's place (a process set's
  // backend takes the world's: its non-members' threads share the cores all the same).
  int size = 1;
  MPI_Comm_size(Comm(comm_), &size);
  const CorePlace mine = ThisCorePlace();
  std::vector<CorePlace> all(size);
  s = Check(MPI_Allgather(&mine, sizeof(mine), MPI_BYTE, all.data(), sizeof(mine), MPI_BYTE, Comm(comm_)),
            "MPI_Allgather (core places)");
  if (!s.ok()) return s;
  sharing_ = CountSharing(mine, all);
  return Attach(layers, topo);
}

Status MpiBackend::InitSubset(const MpiBackend& parent, bool member, const LayerSettings& layers) {
  int parent_rank = 0;
  MPI_Comm_rank(Comm(parent.comm_), &parent_rank);
  MPI_Comm sub = MPI_COMM_NULL;
  Status s = Check(MPI_Comm_split(Comm(parent.comm_), member ? 0 : MPI_UNDEFINED, parent_rank, &sub),
                   "MPI_Comm_split (process set)");
  if (!s.ok() || !member) return s;
  global_rank_ = parent.global_rank_;
  sharing_ = parent.sharing_;
  threads_multiple_ = parent.threads_multiple_;
  comm_ = new MPI_Comm(sub);
  MpiTopology topo;
  return Attach(layers, &topo);
}

Status MpiBackend::Attach(const LayerSettings& layers, MpiTopology* topo) {
  // Failures come back as codes that become statuses instead of aborting the job.
  MPI_Comm_set_errhandler(Comm(comm_), MPI_ERRORS_RETURN);
  MPI_Comm_rank(Comm(comm_), &topo->rank);
  MPI_Comm_size(Comm(comm_), &topo->size);
  topo->sharing = sharing_;
  for (int kind = 0; kind < 2; ++kind) {
    for (int op = 0; op < 5; ++op) {
      MPI_Op* mop = new MPI_Op;
      MPI_Op_create(kHalfFns[kind][op], 1, mop);
      ops_.push_back(mop);
    }
  }
  MPI_Comm* local = new MPI_Comm(MPI_COMM_NULL);
  MPI_Comm* cross = new MPI_Comm(MPI_COMM_NULL);
  Status s = SplitHosts(comm_, layers.host_id, local);
  if (s.ok()) {
    MPI_Comm_rank(*local, &topo->local_rank);
    MPI_Comm_size(*local, &topo->local_size);
    s = Check(MPI_Comm_split(Comm(comm_), topo->local_rank, topo->rank, cross), "MPI_Comm_split (cross)");
  }
  if (s.ok()) {
    MPI_Comm_rank(*cross, &topo->cross_rank);
    MPI_Comm_size(*cross, &topo->cross_size);
    return SetUpLayers(layers, *topo, local, cross);
  }
  if (*local != MPI_COMM_NULL) MPI_Comm_free(local);
  delete local;
  delete cross;
  return s;
}

Status MpiBackend::SetUpLayers(const LayerSettings& settings, const MpiTopology& topo,
                               void* local, void* cross) {
  // Every rank learns every rank's place and settings and decides alike.
  // A host is named by its lowest rank: local rank 0's rank in comm_.
  MPI_Group local_group, group;
  MPI_Comm_group(Comm(local), &local_group);
  MPI_Comm_group(Comm(comm_), &group);
  int zero = 0, leader = 0;
  MPI_Group_translate_ranks(local_group, 1, &zero, group, &leader);
  MPI_Group_free(&local_group);
  MPI_Group_free(&group);
  constexpr int kFields = 7;
  const int mine[kFields] = {topo.local_rank, topo.local_size, settings.hierarchical_allreduce,
                             settings.shared_memory ? 1 : 0, leader,
                             settings.hierarchical_allgather, settings.hierarchical_broadcast};
  std::vector<int> all(kFields * topo.size);
  Status s = Check(MPI_Allgather(mine, kFields, MPI_INT, all.data(), kFields, MPI_INT, Comm(comm_)),
                   "MPI_Allgather (topology)");
  std::vector<RankPlace> places(topo.size);
  for (int r = 0; r < topo.size; ++r) {
    const int* f = &all[kFields * r];
    places[r] = RankPlace{f[0], f[1], f[2], f[3], f[4], f[5], f[6]};
  }
  LayerPlan plan = PlanLayers(places);
  spans_hosts_ = std::count_if(places.begin(), places.end(),
                               [](const RankPlace& p) { return p.local_rank == 0; }) > 1;
  alone_ = topo.size == 1;
  cores_for_each_ = !sharing_.crowded();
  consecutive_hosts_ = true;
  for (int r = 0; r < topo.size; ++r) {
    consecutive_hosts_ = consecutive_hosts_ && places[r].host == r - places[r].local_rank;
  }
  if (s.ok() && !plan.error.empty()) {
    // Every rank found the same disagreement: end MPI together, as a failed init must.
    for (void* c : {local, cross}) MPI_Comm_free(static_cast<MPI_Comm*>(c));
    delete static_cast<MPI_Comm*>(local);
    delete static_cast<MPI_Comm*>(cross);
    Shutdown(true);
    return InvalidArgument(plan.error);
  }
  if (!plan.notice.empty() && topo.rank == 0) {
    HVDLITE_LOG(WARNING) << plan.notice;
  }
  if (s.ok() && (plan.hierarchical_allgather || plan.hierarchical_broadcast || plan.leader_allreduce)) {
    // Communicators of their own (so their collectives never meet the allreduce's):
    // the host's ranks, and on each host's leader the leaders (cross's of local rank 0).
    MPI_Comm* host = new MPI_Comm(MPI_COMM_NULL);
    s = Check(MPI_Comm_dup(Comm(local), host), "MPI_Comm_dup (host)");
    host_group_.reset(new GroupLayer(host));
    if (s.ok() && topo.local_rank == 0) {
      MPI_Comm* leaders = new MPI_Comm(MPI_COMM_NULL);
      s = Check(MPI_Comm_dup(Comm(cross), leaders), "MPI_Comm_dup (leaders)");
      leaders_.reset(new GroupLayer(leaders));
    }
    if (s.ok() && plan.hierarchical_allgather) {
      hierarchical_allgather_.reset(
          new HierarchicalAllgather(host_group_.get(), leaders_.get(), plan.hosts, topo.rank));
    }
    if (s.ok() && plan.hierarchical_broadcast) {
      hierarchical_broadcast_.reset(
          new HierarchicalBroadcast(host_group_.get(), leaders_.get(), plan.hosts, topo.rank));
    }
  }
  if (s.ok() && (plan.world_shared_memory || plan.hierarchical_allreduce || plan.leader_allreduce)) {
    host_ = HostLayer::Open(local, global_rank_);
    local = nullptr;  // the layer's now, or freed with it
  }
  if (s.ok() && (plan.hierarchical_allreduce || plan.leader_allreduce)) {
    // Every host must have its shared-memory group, or every rank goes flat.
    int ok = host_ ? 1 : 0, all_ok = 0;
    s = Check(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, Comm(comm_)), "MPI_Allreduce (layers)");
    if (s.ok() && all_ok && plan.hierarchical_allreduce) {
      cross_.reset(new CrossLayer(cross));
      cross = nullptr;
      cross_every_rank_ = true;
      layered_allreduce_.reset(new HierarchicalAllreduce(host_.get(), cross_.get()));
    } else if (s.ok() && all_ok) {
      if (topo.local_rank == 0) {  // cross is then the leaders
        cross_.reset(new CrossLayer(cross));
        cross = nullptr;
      }
      layered_allreduce_.reset(new LeaderAllreduce(host_.get(), cross_.get(), host_group_.get()));
    } else if (host_) {
      host_->Close(true);
      host_.reset();
    }
  }
  for (void* c : {local, cross}) {
    if (!c) continue;
    MPI_Comm_free(static_cast<MPI_Comm*>(c));
    delete static_cast<MPI_Comm*>(c);
  }
  rank_ = topo.rank;
  size_ = topo.size;
  if (s.ok()) {
    // Every rank must choose the same round (ExchangeRecords' messages against an
    // MPI_Iallreduce would wait forever): agreed here, once.
    int direct = topo.local_size == 1 && spans_hosts_ && topo.size <= kDirectRanks ? 1 : 0, all_direct = 0;
    s = Check(MPI_Allreduce(&direct, &all_direct, 1, MPI_INT, MPI_MIN, Comm(comm_)), "MPI_Allreduce (round)");
    direct_round_ = all_direct == 1;
  }
  // The same on every rank: the plan is, and so is the hosts' number.
  layered_round_ = cross_every_rank_ && cross_->size() <= kDirectRanks;
  return s;
}

void MpiBackend::Shutdown(bool finalize) {
  // Freeing is collective: only on a shutdown every rank takes part in.
  layered_allreduce_.reset();
  hierarchical_allgather_.reset();
  hierarchical_broadcast_.reset();
  for (std::unique_ptr<GroupLayer>* group : {&host_group_, &leaders_}) {
    if (*group) (*group)->Close(finalize);
    group->reset();
  }
  if (cross_) cross_->Close(finalize);
  if (host_) host_->Close(finalize);
  cross_.reset();
  cross_every_rank_ = false;
  layered_round_ = false;
  host_.reset();
  if (finalize) {
    for (void* p : ops_) MPI_Op_free(static_cast<MPI_Op*>(p));
    if (comm_ && Comm(comm_) != MPI_COMM_NULL) MPI_Comm_free(&Comm(comm_));
    g_finalize_at_exit = g_started_mpi;  // at exit: see FinalizeMpiAtExit
  }
  for (void* p : ops_) delete static_cast<MPI_Op*>(p);
  ops_.clear();
  delete static_cast<MPI_Comm*>(comm_);
  comm_ = nullptr;
}

Status MpiBackend::WaitBackoff(void* request, const char* what, std::chrono::microseconds max_sleep,
                               int64_t bytes, int count) {
  MPI_Request* req = static_cast<MPI_Request*>(request);
  // A blocking caller waits: a small transfer's end (or the coordination's) is due
  // within ~100 us, which sleeps would each cost a wake-up.
  const bool spin = caller_waiting_ && bytes <= kCallerSpinMaxBytes;
  PollBackoff backoff(max_sleep, spin ? PollBackoff::kCallerSpin : PollBackoff::kSpin);
  while (true) {
    int flag = 0, rc;
    {
      InMpiCall in_mpi(what);  // each poll: a caller's cycle leaves here once peers are lost
      rc = count == 1 ? MPI_Test(req, &flag, MPI_STATUS_IGNORE) : MPI_Testall(count, req, &flag, MPI_STATUSES_IGNORE);
    }
    if (rc != MPI_SUCCESS) return Check(rc, what);
    if (flag) return Status::OK();
    backoff.Pause();
  }
}

Status MpiBackend::Collective(const char* what, int64_t bytes, const std::function<int(void*)>& call) {
  InMpiCall in_mpi(what);
  if (alone_) return Check(call(nullptr), what);  // a local copy: nothing to wait for
  if (!spans_hosts_) {
    // On one host the blocking call is faster, but it spins until every peer is in.
    NormalPriorityScope normal;
    return Check(call(nullptr), what);
  }
  MPI_Request req;
  Status s = Check(call(&req), what);
  return s.ok() ? WaitBackoff(&req, what, PollBackoff::kDataMaxSleep, bytes) : s;
}

int64_t MpiBackend::CallerCycleBytes(int64_t words) const {
  if (alone_) return threads_multiple_ ? kCallerCycleMaxBytes : 0;
  if (ShmRound(words) && !hierarchical_allgather_ && !hierarchical_broadcast_) {
    return cores_for_each_ ? kCallerCycleMaxBytes : kCallerCycleCrowdedMaxBytes;
  }
  const Round round = RoundFor(words);
  const bool exchange = round == Round::kDirect || round == Round::kLayered;
  return exchange && threads_multiple_ && cores_for_each_ ? ShmCollectives::kCompanionBytes : 0;
}

void MpiBackend::set_caller_waiting(bool waiting) {
  caller_waiting_ = waiting && cores_for_each_;
  if (host_) host_->shm().set_waits_may_poll(caller_waiting_);
  if (cross_) cross_->set_caller_waiting(caller_waiting_);
}

uint8_t* MpiBackend::Companion(int64_t bytes, int64_t words) {
  if (bytes > ShmCollectives::kCompanionBytes) return nullptr;
  switch (RoundFor(words)) {
    case Round::kShm:
    case Round::kLayered:  // the host's step first
      return host_->shm().Companion();
    case Round::kDirect: {
      const size_t most = kRecordHead + ShmCollectives::kCompanionBytes;
      if (record_.size() < most) record_.resize(most);  // ExchangeRecords keeps what is written
      return record_.data() + kRecordHead;
    }
    default:
      return nullptr;
  }
}

int MpiBackend::RoundRanks() const {
  switch (round_) {
    case Round::kShm: return host_->shm().size();
    case Round::kDirect: return size_;
    case Round::kLayered: return cross_->size();
    default: return 0;
  }
}

int64_t MpiBackend::RoundRecord(int k, const uint8_t** data, int64_t* bytes) const {
  if (round_ == Round::kShm) return host_->shm().PeerCompanion(k, data, bytes);
  const uint8_t* record = k == record_rank_ ? record_.data() : records_[k].data();
  const int64_t* head = reinterpret_cast<const int64_t*>(record);
  *data = record + kRecordHead;
  *bytes = head[1];
  return head[0];
}

namespace {

// The data that came with a round for `carried`, from n records (record(k, &data,
// &bytes) gives record k's tag): an allreduce's from each, a broadcast's from the one
// record with data (the others carry the tag alone), an allgather's or alltoall's from
// each with its length. False where a record did not carry the op or carried the wrong
// length; the caller checks how many came.
template <typename Record>
bool TakeParts(const CarriedOp& carried, int n, Record record, std::vector<const uint8_t*>* parts,
               std::vector<int64_t>* lengths) {
  parts->clear();
  lengths->clear();
  if (carried.tag < 0) return false;
  for (int k = 0; k < n; ++k) {
    const uint8_t* data = nullptr;
    int64_t bytes = 0;
    if (record(k, &data, &bytes) != carried.tag) return false;
    if (carried.gather || bytes == carried.nbytes) {
      parts->push_back(data);
      lengths->push_back(bytes);
    } else if (carried.root < 0 || bytes != 0) {
      return false;
    }
  }
  return true;
}

}  // namespace

bool MpiBackend::CarriedParts(const CarriedOp& carried, std::vector<const uint8_t*>* parts,
                               std::vector<int64_t>* lengths) const {
  // A broadcast's root's data: in the layered round the record from the root's host,
  // which forwards it.
  const int n = RoundRanks();
  const auto record = [this](int k, const uint8_t** data, int64_t* bytes) {
    return RoundRecord(k, data, bytes);
  };
  if (n == 0 || !TakeParts(carried, n, record, parts, lengths)) return false;
  return carried.root < 0 ? static_cast<int>(parts->size()) == n : parts->size() == 1;
}

bool MpiBackend::CarriesInDataOrder(int64_t words, const AllreduceTuning& tuning) const {
  const Round round = RoundFor(words);
  return round == Round::kShm ||
         (round == Round::kLayered && ChooseAllreduce(tuning) == AllreduceAlgorithm::kLayers);
}

int64_t MpiBackend::CombineHost(const CarriedOp& carried, int64_t* bytes) {
  // Every rank of the host reads the same companions: all decide alike, and an
  // allreduce's sum has the same bits on each (as the layered allreduce's shared-memory
  // reduce-scatter: each rank's prescaled data, in rank order).
  ShmCollectives& shm = host_->shm();
  *bytes = 0;
  if (carried.gather && !consecutive_hosts_) return -1;
  std::vector<const uint8_t*> parts;
  std::vector<int64_t> lengths;
  const auto record = [&shm](int k, const uint8_t** data, int64_t* n) {
    return shm.PeerCompanion(k, data, n);
  };
  if (!TakeParts(carried, shm.size(), record, &parts, &lengths)) return -1;
  uint8_t* out = record_.data() + kRecordHead;
  if (carried.gather) {  // the host's ranks' parts, in rank order
    for (size_t k = 0; k < parts.size(); ++k) {
      if (*bytes + lengths[k] > ShmCollectives::kCompanionBytes) return -1;
      std::memcpy(out + *bytes, parts[k], lengths[k]);
      *bytes += lengths[k];
    }
  } else if (carried.root < 0) {
    ReduceElements(out, parts, carried.count, carried.dtype, carried.reduce_op);
    *bytes = carried.nbytes;
  } else if (parts.size() == 1) {  // the root is on this host
    std::memcpy(out, parts[0], carried.nbytes);
    *bytes = carried.nbytes;
  } else if (!parts.empty()) {
    return -1;
  }
  return carried.tag;
}

Status MpiBackend::ExchangeRecords(void* comm, int rank, int size, std::vector<uint64_t>* bits,
                                   int64_t tag, int64_t bytes) {
  // One trip: every rank's record to every other, received into room for the largest
  // (a companion's length need not be known ahead), then ANDed here.
  const int64_t words = static_cast<int64_t>(bits->size());
  const int64_t carried = tag < 0 ? 0 : bytes;
  const auto bits_at = [](int64_t companion) { return kRecordHead + (companion + 7) / 8 * 8; };
  const size_t most = static_cast<size_t>(bits_at(ShmCollectives::kCompanionBytes) + words * 8);
  if (record_.size() < most) record_.resize(most);
  int64_t* head = reinterpret_cast<int64_t*>(record_.data());
  head[0] = tag;
  head[1] = carried;
  std::memcpy(record_.data() + bits_at(carried), bits->data(), words * 8);
  record_rank_ = rank;
  records_.resize(size);
  std::vector<MPI_Request> requests;
  requests.reserve(2 * (size - 1));
  InMpiCall in_mpi("MPI_Isend/MPI_Irecv (coordination)");
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    if (records_[peer].size() < most) records_[peer].resize(most);
    requests.emplace_back();
    Status s = Check(MPI_Irecv(records_[peer].data(), static_cast<int>(most), MPI_BYTE, peer, kRoundTag,
                               Comm(comm), &requests.back()),
                     "MPI_Irecv (coordination)");
    if (!s.ok()) return s;
    requests.emplace_back();
    s = Check(MPI_Isend(record_.data(), static_cast<int>(bits_at(carried) + words * 8), MPI_BYTE, peer,
                        kRoundTag, Comm(comm), &requests.back()),
              "MPI_Isend (coordination)");
    if (!s.ok()) return s;
  }
  Status s = WaitBackoff(requests.data(), "MPI_Isend/MPI_Irecv (coordination)", PollBackoff::kWaitMaxSleep,
                         carried, static_cast<int>(requests.size()));
  if (!s.ok()) return s;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    const int64_t* theirs = reinterpret_cast<const int64_t*>(records_[peer].data());
    if (theirs[1] < 0 || theirs[1] > ShmCollectives::kCompanionBytes) {
      return Status(HVDLITE_ERR_MPI, "rank " + std::to_string(peer) +
                                               "'s coordination record is malformed (companion of " +
                                               std::to_string(theirs[1]) + " bytes)");
    }
    const uint64_t* their_bits = reinterpret_cast<const uint64_t*>(records_[peer].data() + bits_at(theirs[1]));
    for (int64_t i = 0; i < words; ++i) (*bits)[i] &= their_bits[i];
  }
  return Status::OK();
}

Status MpiBackend::AndBits(std::vector<uint64_t>* bits, const CarriedOp& carried) {
  const int64_t words = static_cast<int64_t>(bits->size());
  round_ = RoundFor(words);
  // What this rank wrote into Companion(): an allreduce's data, a broadcast root's.
  const int64_t mine = carried.tag < 0 || (carried.root >= 0 && carried.root != rank_) ? 0 : carried.nbytes;
  switch (round_) {
    case Round::kShm:
      return host_->shm().AndBits(bits->data(), words, carried.tag, mine);
    case Round::kDirect:
      return ExchangeRecords(comm_, rank_, size_, bits, carried.tag, mine);
    case Round::kLayered: {
      // The host's AND through shared memory, then the hosts' by one exchange among the
      // ranks of this local rank (the cross layer): every rank ends with the AND of all
      // after one network trip among as many ranks as hosts, where MPI's allreduce over
      // every rank takes log2(size) trips, its host's peers over the network transport
      // too (namespace cluster, 2 hosts x 2 ranks, a 4 KiB allreduce: rank 0's round,
      // enqueue to "all ranks ready", 615 -> 58 us). A carried op's data rides in both.
      Status s = host_->shm().AndBits(bits->data(), words, carried.tag, mine);
      if (!s.ok()) return s;
      const size_t most = kRecordHead + ShmCollectives::kCompanionBytes;
      if (record_.size() < most) record_.resize(most);
      int64_t bytes = 0;
      const int64_t tag = CombineHost(carried, &bytes);
      return ExchangeRecords(cross_->comm(), cross_->rank(), cross_->size(), bits, tag, bytes);
    }
    default:
      break;
  }
  if (alone_) return Status::OK();  // the AND of one vector
  void* comm = comm_;
  if (host_ && cross_every_rank_ && words <= ShmCollectives::kMaxBitsWords) {
    // More hosts than an exchange serves: the host's AND, then MPI's among the hosts.
    Status s = host_->shm().AndBits(bits->data(), words);
    if (!s.ok()) return s;
    comm = cross_->comm();
  }
  InMpiCall in_mpi("MPI_Iallreduce (coordination)");
  MPI_Request req;
  Status s = Check(MPI_Iallreduce(MPI_IN_PLACE, bits->data(), static_cast<int>(bits->size()),
                                  MPI_UINT64_T, MPI_BAND, Comm(comm), &req),
                   "MPI_Iallreduce (coordination)");
  if (!s.ok()) return s;
  return WaitBackoff(&req, "MPI_Iallreduce (coordination)");
}

Status MpiBackend::GatherBlobs(const std::vector<uint8_t>& mine,
                               std::vector<std::vector<uint8_t>>* all) {
  if (alone_) {
    *all = {mine};
    return Status::OK();
  }
  if (ShmGathers()) return ShmGatherBlobs(mine, all);
  InMpiCall in_mpi("MPI_Igather (negotiation)");
  int rank, size;
  MPI_Comm_rank(Comm(comm_), &rank);
  MPI_Comm_size(Comm(comm_), &size);
  const int my_len = gather_len_ = static_cast<int>(mine.size());
  std::vector<int> lens(rank == 0 ? size : 0);
  MPI_Request req;
  Status s = Check(MPI_Igather(&gather_len_, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, Comm(comm_), &req),
                   "MPI_Igather (negotiation)");
  if (!s.ok() || !(s = WaitBackoff(&req, "MPI_Igather (negotiation)")).ok()) return s;
  std::vector<int> displs(rank == 0 ? size : 0);
  std::vector<uint8_t> flat;
  if (rank == 0) {
    int total = 0;
    for (int r = 0; r < size; ++r) {
      displs[r] = total;
      total += lens[r];
    }
    flat.resize(total);
  }
  s = Check(MPI_Igatherv(mine.data(), my_len, MPI_BYTE, flat.data(), lens.data(), displs.data(),
                         MPI_BYTE, 0, Comm(comm_), &req),
            "MPI_Igatherv (negotiation)");
  if (!s.ok() || !(s = WaitBackoff(&req, "MPI_Igatherv (negotiation)")).ok()) return s;
  all->clear();
  if (rank == 0) {
    for (int r = 0; r < size; ++r) {
      all->emplace_back(flat.begin() + displs[r], flat.begin() + displs[r] + lens[r]);
    }
  }
  return Status::OK();
}

Status MpiBackend::ShmGatherBlobs(const std::vector<uint8_t>& mine,
                                  std::vector<std::vector<uint8_t>>* all) {
  ShmCollectives& shm = host_->shm();
  const int size = shm.size(), rank = shm.rank();
  // Every rank's length first (each rank needs them all to take part in the second
  // step), then the blobs, kept on rank 0 only.
  const int64_t my_len = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lens(size, 0);
  std::vector<int64_t> eight(size, sizeof(int64_t));
  Status s = shm.Allgather(&my_len, {{nullptr, lens.data(), size * int64_t{sizeof(int64_t)}}}, 0,
                           Bounds(eight), HVDLITE_UINT8, 1.0, 1);
  if (!s.ok()) return s;
  int64_t total = 0;
  for (int64_t n : lens) total += n;
  std::vector<uint8_t> flat(rank == 0 ? total : 0);
  s = shm.Allgather(mine.data(), {{nullptr, rank == 0 ? flat.data() : nullptr, total}}, 0, Bounds(lens),
                    HVDLITE_UINT8, 1.0, 1);
  if (!s.ok()) return s;
  all->clear();
  if (rank == 0) {
    int64_t at = 0;
    for (int64_t n : lens) {
      all->emplace_back(flat.begin() + at, flat.begin() + at + n);
      at += n;
    }
  }
  return Status::OK();
}

Status MpiBackend::BroadcastBlob(std::vector<uint8_t>* blob) {
  if (alone_) return Status::OK();
  if (ShmGathers()) {
    int64_t len = static_cast<int64_t>(blob->size());
    Status s = host_->shm().Broadcast(&len, &len, sizeof(len), 0);
    if (!s.ok()) return s;
    blob->resize(len);
    return len == 0 ? Status::OK() : host_->shm().Broadcast(blob->data(), blob->data(), len, 0);
  }
  InMpiCall in_mpi("MPI_Ibcast (responses)");
  broadcast_len_ = static_cast<int64_t>(blob->size());
  MPI_Request req;
  Status s = Check(MPI_Ibcast(&broadcast_len_, 1, MPI_INT64_T, 0, Comm(comm_), &req), "MPI_Ibcast (responses)");
  if (!s.ok() || !(s = WaitBackoff(&req, "MPI_Ibcast (responses)")).ok()) return s;
  const int64_t len = broadcast_len_;
  blob->resize(len);
  if (len == 0) return Status::OK();
  s = Check(MPI_Ibcast(blob->data(), static_cast<int>(len), MPI_BYTE, 0, Comm(comm_), &req),
            "MPI_Ibcast (responses)");
  if (!s.ok()) return s;
  return WaitBackoff(&req, "MPI_Ibcast (responses)");
}

Status MpiBackend::Allreduce(const std::vector<ShmCollectives::Piece>& pieces,
                             const AllreduceOptions& options, const AllreduceTuning& tuning,
                             FusionBuffer* fusion, const LayeredAllreduce::StepDone& step_done) {
  switch (ChooseAllreduce(tuning)) {
    case AllreduceAlgorithm::kLayers:
      // The plan's steps over the topology layers (hierarchical_allreduce.h).
      return layered_allreduce_->Allreduce(pieces, options, step_done);
    case AllreduceAlgorithm::kSharedMemory: {
      // Straight from the inputs through shared memory into the outputs, scaled on the
      // way: no fusion buffer and no separate scaling pass.
      host_->shm().set_chunk_bytes(tuning.shm_chunk_bytes);
      Status s = host_->shm().Allreduce(pieces, options);
      step_done("SHM_ALLREDUCE");
      return s;
    }
    case AllreduceAlgorithm::kMpi:
      break;
  }
  return FlatAllreduce(pieces, options, fusion, step_done);
}

Status MpiBackend::FlatAllreduce(const std::vector<ShmCollectives::Piece>& pieces,
                                 const AllreduceOptions& options, FusionBuffer* fusion,
                                 const LayeredAllreduce::StepDone& step_done) {
  const int32_t dtype = options.dtype;
  const int elem = ElementSize(dtype);
  int64_t total = 0;
  for (const ShmCollectives::Piece& p : pieces) total += p.count;
  Status s;
  if (pieces.size() == 1 && pieces[0].out) {
    // One tensor: reduce in its output buffer, no fusion-buffer round trip.
    const ShmCollectives::Piece& p = pieces[0];
    // Unscaled input goes to MPI as the send buffer: no copy at all.
    const void* send = p.in;
    if (options.prescale != 1.0) {
      ScaledCopy(p.out, p.in, total, dtype, options.prescale, 1);
      send = p.out;
    }
    step_done("MEMCPY_IN_FUSION_BUFFER");
    s = MpiAllreduce(send, p.out, total, dtype, options.reduce_op);
    step_done("MPI_ALLREDUCE");
    if (s.ok()) ScaledCopy(p.out, p.out, total, dtype, options.postscale, options.divisor);
    step_done("MEMCPY_OUT_FUSION_BUFFER");
    return s;
  }
  uint8_t* buf = fusion->Get(total * elem);
  int64_t off = 0;
  for (const ShmCollectives::Piece& p : pieces) {
    if (p.in) {
      ScaledCopy(buf + off * elem, p.in, p.count, dtype, options.prescale, 1);
    } else {
      std::memset(buf + off * elem, 0, p.count * elem);  // a joined rank contributes zeros
    }
    off += p.count;
  }
  step_done("MEMCPY_IN_FUSION_BUFFER");
  s = MpiAllreduce(buf, buf, total, dtype, options.reduce_op);
  step_done("MPI_ALLREDUCE");
  off = 0;
  for (size_t k = 0; k < pieces.size() && s.ok(); ++k) {
    if (pieces[k].out) {
      ScaledCopy(pieces[k].out, buf + off * elem, pieces[k].count, dtype, options.postscale, options.divisor);
    }
    off += pieces[k].count;
  }
  step_done("MEMCPY_OUT_FUSION_BUFFER");
  return s;
}

Status MpiBackend::MpiAllreduce(const void* in, void* out, int64_t count, int32_t dtype,
                                int32_t reduce_op) {
  MPI_Datatype type = MpiType(dtype);
  MPI_Op op = StandardOp(reduce_op);
  if (dtype == HVDLITE_FLOAT16 || dtype == HVDLITE_BFLOAT16) {
    op = *static_cast<MPI_Op*>(ops_[(dtype == HVDLITE_BFLOAT16 ? 5 : 0) + reduce_op]);
  }
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  int elem = ElementSize(dtype);
  for (int64_t done = 0; done < count;) {
    int64_t n = std::min(kMaxChunk, count - done);
    const void* send = in == out ? MPI_IN_PLACE : src + done * elem;
    void* recv = dst + done * elem;
    Status s = Collective("MPI_Allreduce", n * elem, [&](void* r) {
      return r ? MPI_Iallreduce(send, recv, static_cast<int>(n), type, op, Comm(comm_), static_cast<MPI_Request*>(r))
               : MPI_Allreduce(send, recv, static_cast<int>(n), type, op, Comm(comm_));
    });
    if (!s.ok()) return s;
    done += n;
  }
  return Status::OK();
}

// Byte counts must fit MPI's int; larger single collectives would need the
// large-count (_c) variants.
static Status ToIntCounts(const std::vector<int64_t>& in, std::vector<int>* counts,
                          std::vector<int>* displs, const char* what) {
  counts->resize(in.size());
  displs->resize(in.size());
  int64_t off = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] > INT_MAX || off > INT_MAX) {
      return Status(HVDLITE_ERR_INVALID_ARGUMENT,
                    std::string(what) + ": more than 2 GiB per collective is not supported yet");
    }
    (*counts)[i] = static_cast<int>(in[i]);
    (*displs)[i] = static_cast<int>(off);
    off += in[i];
  }
  return Status::OK();
}

Status MpiBackend::Allgatherv(const void* in, int64_t in_bytes, void* out,
                              const std::vector<int64_t>& bytes_per_rank) {
  if (hierarchical_allgather_) return hierarchical_allgather_->Allgatherv(in, in_bytes, out, bytes_per_rank);
  int64_t total = 0;
  for (int64_t n : bytes_per_rank) total += n;
  if (ShmGathers()) return ShmAllgatherv(in, {{nullptr, out, total}}, bytes_per_rank);
  std::vector<int> counts, displs;
  Status s = ToIntCounts(bytes_per_rank, &counts, &displs, "allgather");
  if (!s.ok()) return s;
  return Collective("MPI_Allgatherv", total, [&](void* r) {
    return r ? MPI_Iallgatherv(in, static_cast<int>(in_bytes), MPI_BYTE, out, counts.data(), displs.data(),
                               MPI_BYTE, Comm(comm_), static_cast<MPI_Request*>(r))
             : MPI_Allgatherv(in, static_cast<int>(in_bytes), MPI_BYTE, out, counts.data(), displs.data(),
                              MPI_BYTE, Comm(comm_));
  });
}

Status MpiBackend::ShmAllgatherv(const void* in, const std::vector<ShmCollectives::Piece>& outs,
                                 const std::vector<int64_t>& bytes_per_rank) {
  return host_->shm().Allgather(in, outs, 0, Bounds(bytes_per_rank), HVDLITE_UINT8, 1.0, 1);
}

Status MpiBackend::Bcast(const void* in, void* buf, int64_t nbytes, int root) {
  // On one host the root's result is filled round by round beside the others' copies;
  // elsewhere the root's input is copied into it first, and the broadcast is in place.
  if (!hierarchical_broadcast_ && ShmGathers()) return host_->shm().Broadcast(in, buf, nbytes, root);
  if (rank_ == root && in != buf && nbytes > 0) std::memcpy(buf, in, nbytes);
  if (hierarchical_broadcast_) return hierarchical_broadcast_->Bcast(buf, nbytes, root);
  char* p = static_cast<char*>(buf);
  for (int64_t done = 0; done < nbytes;) {
    int64_t n = std::min(kMaxChunk, nbytes - done);
    Status s = Collective("MPI_Bcast", n, [&](void* r) {
      return r ? MPI_Ibcast(p + done, static_cast<int>(n), MPI_BYTE, root, Comm(comm_), static_cast<MPI_Request*>(r))
               : MPI_Bcast(p + done, static_cast<int>(n), MPI_BYTE, root, Comm(comm_));
    });
    if (!s.ok()) return s;
    done += n;
  }
  return Status::OK();
}

Status MpiBackend::Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                             const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>* matrix) {
  if (matrix && ShmGathers()) return host_->shm().Alltoall(in, *matrix, out);
  std::vector<int> sc, sd, rc, rd;
  Status s = ToIntCounts(send_bytes, &sc, &sd, "alltoall");
  if (!s.ok() || !(s = ToIntCounts(recv_bytes, &rc, &rd, "alltoall")).ok()) return s;
  int64_t moved = 0;
  for (size_t k = 0; k < send_bytes.size(); ++k) moved += std::max(send_bytes[k], recv_bytes[k]);
  return Collective("MPI_Alltoallv", moved, [&](void* r) {
    return r ? MPI_Ialltoallv(in, sc.data(), sd.data(), MPI_BYTE, out, rc.data(), rd.data(), MPI_BYTE,
                              Comm(comm_), static_cast<MPI_Request*>(r))
             : MPI_Alltoallv(in, sc.data(), sd.data(), MPI_BYTE, out, rc.data(), rd.data(), MPI_BYTE,
                             Comm(comm_));
  });
}

Status MpiBackend::ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts,
                                 int32_t dtype, int32_t reduce_op) {
  if (ShmGathers()) {
    const std::vector<int64_t> bounds = Bounds(counts);
    return host_->shm().ReduceScatter({{in, nullptr, bounds.back()}}, 0, bounds, dtype, reduce_op, 1.0, out);
  }
  std::vector<int> c, d;
  Status s = ToIntCounts(counts, &c, &d, "reducescatter");
  if (!s.ok()) return s;
  MPI_Op op = StandardOp(reduce_op);
  if (dtype == HVDLITE_FLOAT16 || dtype == HVDLITE_BFLOAT16) {
    op = *static_cast<MPI_Op*>(ops_[(dtype == HVDLITE_BFLOAT16 ? 5 : 0) + reduce_op]);
  }
  int64_t elements = 0;
  for (int64_t n : counts) elements += n;
  return Collective("MPI_Reduce_scatter", elements * ElementSize(dtype), [&](void* r) {
    return r ? MPI_Ireduce_scatter(in, out, c.data(), MpiType(dtype), op, Comm(comm_), static_cast<MPI_Request*>(r))
             : MPI_Reduce_scatter(in, out, c.data(), MpiType(dtype), op, Comm(comm_));
  });
}

std::string MpiBackend::LibraryVersion() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  return std::string(buf, len);
}

}  // namespace hvdlite
