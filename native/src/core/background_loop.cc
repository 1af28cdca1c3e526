// The background loop.
//
// Why one thread owns every MPI call: collectives must run in the same order on every
// rank, and the order is decided here, cycle by cycle, from one response list that is
// identical everywhere. Framework threads only validate, enqueue and wait, so no
// framework thread can ever issue a collective out of that order, and MPI needs no
// locking of ours.
//
// One cycle pops the new requests and hands each to its process set (Core::RunCycle);
// then every set this rank belongs to runs its round, in id order (ProcessSetState::
// RunCycle; process_set.h says why that order cannot deadlock):
//  1. sort the set's new requests: each is a response-cache hit (its slot's bit will be
//     set), a changed cache entry (its slot is invalidated everywhere), or uncached;
//  2. one MPI_Iallreduce(BAND) over [flags | hit bits | invalid bits] tells every rank
//     which cached tensors are ready everywhere, which slots to drop, and whether
//     anyone has uncached requests, has joined, asked to shut down, or has ops in
//     flight in another set (RoundFlags);
//  3. only if someone has uncached requests: gather them on the set's rank 0, whose
//     Controller checks them across ranks and broadcasts the new responses;
//  4. execute cached-ready responses (slot order) then new ones (broadcast order),
//     fusing consecutive compatible allreduces up to the fusion threshold;
//  5. complete the handles.
#include "core/background_loop.h"
#include "transport/mpi_fault_guard.h"

#include <sys/prctl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>

#include "common/thread_sched.h"

namespace hvdlite {
namespace {

constexpr const char* kJoinName = "__join__";
// Over MPI, tensors this large are reduced alone, in place: copying them into and out
// of the fusion buffer costs more than the collective's fixed latency that fusion
// saves. (Through shared memory every tensor is read in place, so any size fuses.)
constexpr int64_t kFuseAloneBytes = 1 << 20;
// A burst of requests is gathered until none arrived for this long (a submitting
// thread adds one every few microseconds, but may lose its core for a while on a
// busy machine), a thread waits for a result, or a cycle time after the first.
constexpr std::chrono::microseconds kQuiet(200);
// How often a rank with nothing in flight still joins the coordination.
constexpr std::chrono::milliseconds kIdleCycle(20);
// How long a rank keeps the cycle time after it last heard of ops in flight in another
// set (RoundFlags::elsewhere): a loop of ops in a set leaves the queues of its members
// empty for a moment between two ops, and an outside rank that went idle then would
// hold back the next op's round of set 0 by up to kIdleCycle.
constexpr std::chrono::milliseconds kElsewhereLinger(200);

// values holds kSettings values per rank; the one at `index` must be equal on every rank.
constexpr int kSettings = 4;
Status SameOnEveryRank(const std::vector<int64_t>& values, int index, const char* setting) {
  std::vector<std::string> per_rank;
  for (size_t r = index; r < values.size(); r += kSettings) {
    per_rank.push_back(std::to_string(values[r]));
  }
  std::string diff = Disagreement(per_rank);
  if (diff.empty()) return Status::OK();
  return InvalidArgument(std::string(setting) + " must be the same on every rank: " + diff);
}

// Bytes one rank sends to the others in a collective whose buffer (allreduce) or result
// (allgather, broadcast, reducescatter's input) is `payload` bytes, counted as a
// bandwidth-optimal algorithm sends them, whichever path ran: what a compressor saves is
// then counted the same way for every op (hvdlite_stats_t.wire_bytes).
int64_t WireBytes(int32_t op, int64_t payload, int size) {
  if (size <= 1) return 0;
  const int64_t share = payload / size * (size - 1);
  return op == HVDLITE_OP_ALLREDUCE ? 2 * share : share;
}

Status NotInitialized() {
  return Status(HVDLITE_ERR_NOT_INITIALIZED,
                "hvdlite is not initialized: call hvdlite.init() first");
}

int64_t RowElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

// Timeline names by HVDLITE_OP_*: the negotiation and the operation span.
const char* const kNegotiateActivity[] = {"NEGOTIATE_ALLREDUCE", "NEGOTIATE_ALLGATHER",
                                          "NEGOTIATE_BROADCAST", "NEGOTIATE_ALLTOALL",
                                          "NEGOTIATE_REDUCESCATTER", "NEGOTIATE_BARRIER",
                                          "NEGOTIATE_JOIN", "NEGOTIATE_ADD_PROCESS_SET",
                                          "NEGOTIATE_REMOVE_PROCESS_SET"};
const char* const kOpActivity[] = {"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL",
                                   "REDUCESCATTER", "BARRIER", "JOIN", "ADD_PROCESS_SET",
                                   "REMOVE_PROCESS_SET"};

// Arguments of an op's timeline span. bytes: what rank 0 contributes or receives.
std::string TimelineArgs(const Response& r, size_t fused, int rank, int size) {
  const int64_t elem = ElementSize(r.dtype);
  const int64_t row = RowElements(r.shape) * elem;
  int64_t bytes = NumElements(r.shape) * elem;
  if (r.op == HVDLITE_OP_ALLGATHER) {
    bytes = 0;
    for (int64_t rows : r.first_dims) bytes += rows * row;
  } else if (r.op == HVDLITE_OP_ALLTOALL) {
    bytes = 0;
    for (int k = 0; k < size && static_cast<size_t>(k) * size + rank < r.splits.size(); ++k) {
      bytes += r.splits[static_cast<size_t>(k) * size + rank] * row;
    }
  } else if (r.op == HVDLITE_OP_BARRIER) {
    bytes = 0;
  }
  std::string args = std::string("\"dtype\": \"") + DtypeName(r.dtype) + "\", \"shape\": \"" +
                     ShapeString(r.shape) + "\", \"bytes\": " + std::to_string(bytes);
  if (r.op == HVDLITE_OP_ALLREDUCE) args += ", \"fused\": " + std::to_string(fused);
  return args;
}

// The timeline activity of each op's collective itself, by HVDLITE_OP_*.
const char* const kCollectiveActivity[] = {"MPI_ALLREDUCE", "MPI_ALLGATHER", "MPI_BROADCAST",
                                           "MPI_ALLTOALL", "MPI_REDUCESCATTER", "MPI_BARRIER",
                                           "MPI_JOIN", "MPI_COMM_SPLIT", "MPI_COMM_FREE"};

// The activities of one execution on the timeline, one after the other: each ends
// where the next begins and is recorded, once ended, as one event over all the
// execution's tracks. Does nothing while the timeline is off.
class Activities {
 public:
  Activities(Timeline& timeline, const std::vector<const std::string*>& tensors, int64_t start_us)
      : timeline_(timeline), tids_(timeline.OpenTracks(tensors)), start_us_(start_us) {}
  // The activity that began where the previous one ended has ended now.
  void Done(const char* activity) {
    if (tids_.empty()) return;
    int64_t now = Timeline::Now();
    timeline_.Complete(tids_, activity, start_us_, now);
    start_us_ = now;
  }

 private:
  Timeline& timeline_;
  std::vector<int> tids_;
  int64_t start_us_;
};

// A digest of everything TimelineArgs shows.
uint64_t TimelineArgsKey(const Response& r, size_t fused) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  mix(static_cast<uint64_t>(r.op));
  mix(static_cast<uint64_t>(r.dtype));
  mix(fused);
  for (int64_t d : r.shape) mix(static_cast<uint64_t>(d));
  mix(~0ull);
  for (int64_t d : r.first_dims) mix(static_cast<uint64_t>(d));
  mix(~0ull);
  for (int64_t s : r.splits) mix(static_cast<uint64_t>(s));
  return h;
}

// HVDLITE_BIND_TO=core: this rank's threads on its share of the host's cores.
void BindThisRank(const MpiTopology& topo) {
  std::string why;
  const std::vector<int> cores = BindToCoreShare(topo.local_rank, topo.local_size, &why);
  if (cores.empty()) {
    HVDLITE_LOG(WARNING) << "HVDLITE_BIND_TO=core: not binding local rank " << topo.local_rank << ": " << why;
    return;
  }
  std::string list;
  for (int c : cores) list += (list.empty() ? "" : ",") + std::to_string(c);
  HVDLITE_LOG(INFO) << "local rank " << topo.local_rank << " of " << topo.local_size << " bound to cores " << list;
}

// Once init's collectives are done (they may wait seconds for a peer still importing
// its framework, inside MPI calls that poll), the background thread goes real-time
// unless HVDLITE_BACKGROUND_REALTIME=0 (thread_sched.h).
void MakeBackgroundRealtime(const Config& config, const MpiTopology& topo) {
  if (config.background_realtime == 0) return;
  std::string why;
  if (RequestRealtime(topo.local_size, &why)) {
    HVDLITE_LOG(DEBUG) << "background thread real-time (SCHED_FIFO)";
  } else if (config.background_realtime == 1) {
    HVDLITE_LOG(WARNING) << "HVDLITE_BACKGROUND_REALTIME=1: the background thread stays at normal priority: " << why;
  } else {
    HVDLITE_LOG(DEBUG) << "background thread at normal priority: " << why;
  }
}

}  // namespace

Core& Core::Get() {
  // Never destroyed: the background thread may outlive static destruction order.
  static Core* core = [] {
    Core* c = new Core();
    // A thread blocking on a result ends the gathering of a burst (WaitForQuiet).
    c->handles_.set_on_block([c] { c->queue_.Hurry(); });
    return c;
  }();
  return *core;
}

Status Core::CheckRunning() const {
  if (!running_) return NotInitialized();
  return Status::OK();
}

Status Core::Init(int64_t comm_f2c) {
  std::lock_guard<std::mutex> lock(lifecycle_mutex_);
  if (running_) {
    return Status(HVDLITE_ERR_ALREADY_INITIALIZED, "hvdlite is already initialized");
  }
  if (thread_.joinable()) thread_.join();
  Config config;
  Status s = LoadConfig(&config);
  if (!s.ok()) return s;
  config_ = config;
  {
    std::lock_guard<std::mutex> change_lock(change_mutex_);
    changes_ = 0;
  }
  shutdown_requested_ = false;
  loop_ended_ = false;
  {
    std::lock_guard<std::mutex> end_lock(end_mutex_);
    end_status_ = Status::OK();
  }
  std::promise<Status> started;
  std::future<Status> result = started.get_future();
  thread_ = std::thread([this, comm_f2c, &started] {
    // Short sleeps in the loop (backoff while a peer catches up) should last what they
    // ask for, not the default 50 us timer slack on top.
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    // Its own name in top, perf and /proc/PID/task (the training threads are "python"),
    // once MPI is up: threads MPI starts from it meanwhile (Open MPI's) inherit the name
    // it has then.
    prctl(PR_SET_NAME, "hvdlite-mpi", 0, 0, 0);
    // Wakes take the core from a training thread at once rather than after its slice:
    // each chunk of a shared-memory allreduce waits for the peers' background threads.
    RequestShortSlice(kBackgroundSliceNs);
    MpiTopology topo;
    std::unique_ptr<MpiBackend> world(new MpiBackend());
    Status st = world->Init(comm_f2c, config_.mpi_thread_multiple, LayersOf(config_), &topo);
    prctl(PR_SET_NAME, "hvdlite-loop", 0, 0, 0);
    if (st.ok()) {
      topo_ = topo;
      SetLogRank(topo.rank);
      if (config_.bind_to_core) BindThisRank(topo);
      if (topo.rank == 0 && !config_.timeline_path.empty()) {
        st = timeline_.Start(config_.timeline_path, config_.timeline_mark_cycles);
      }
      if (st.ok()) {
        st = autotune_.Start(config_.autotune, config_, topo.rank, world->shared_memory(),
                             world->hierarchical() != nullptr);
      }
      // Every rank learns whether rank 0 could open the timeline, so a bad path fails
      // init everywhere instead of leaving the others waiting for rank 0. Done
      // whatever the local config says: HVDLITE_TIMELINE may be set on rank 0 only.
      // Also every rank's settings that must agree, or the ranks would coordinate with
      // bit vectors of different lengths or plan different fusions: a hang or wrong
      // results later, a clear error now.
      const int64_t mine[kSettings] = {st.ok() ? 1 : 0, config_.cache_capacity,
                                       config_.fusion_threshold, config_.autotune.enabled ? 1 : 0};
      std::vector<int64_t> all(kSettings * topo.size);
      Status agree = world->Allgatherv(mine, sizeof(mine), all.data(),
                                       std::vector<int64_t>(topo.size, sizeof(mine)));
      if (st.ok() && !agree.ok()) st = agree;
      if (st.ok() && all[0] == 0) {
        st = InvalidArgument("rank 0 cannot write the timeline (HVDLITE_TIMELINE) or the autotune log "
                             "(HVDLITE_AUTOTUNE_LOG); its error says why");
      }
      if (st.ok()) st = SameOnEveryRank(all, 1, "HVDLITE_CACHE_CAPACITY");
      if (st.ok()) st = SameOnEveryRank(all, 2, "HVDLITE_FUSION_THRESHOLD");
      // Autotune adds words to every coordination round (autotune.h).
      if (st.ok()) st = SameOnEveryRank(all, 3, "HVDLITE_AUTOTUNE");
      if (!st.ok()) {
        timeline_.Stop();
        autotune_.Stop();
        world->Shutdown(true);
      }
    }
    bool ok = st.ok();
    if (ok) {
      // The global set, 0: every rank, on the world's communicator.
      std::vector<int> everyone(topo.size);
      for (int r = 0; r < topo.size; ++r) everyone[r] = r;
      auto members = std::make_shared<const ProcessSetMembers>(0, everyone, topo.rank);
      sets_.Insert(std::unique_ptr<ProcessSetState>(new ProcessSetState(
          members, std::move(world),
          CoreParts{config_, queue_, handles_, counters_, timeline_, sets_, autotune_,
                    [this](const Status& failure) { EndLoop(failure); }})));
    }
    if (ok) MakeBackgroundRealtime(config_, topo);
    started.set_value(st);
    if (ok) Loop();
  });
  s = result.get();
  if (!s.ok()) {
    thread_.join();
    return s;
  }
  running_ = true;
  HVDLITE_LOG(DEBUG) << "initialized: rank " << topo_.rank << " of " << topo_.size;
  return Status::OK();
}

Status Core::Shutdown() {
  std::lock_guard<std::mutex> lock(lifecycle_mutex_);
  if (!thread_.joinable()) return Status::OK();
  if (MpiFaulted()) {
    // The thread is parked in the fault handler for good: joining would never return.
    return Status(HVDLITE_ERR_MPI,
                  "hvdlite cannot shut down: its background thread faulted inside MPI "
                  "(a lost peer?) and is stopped; end the process");
  }
  shutdown_requested_ = true;
  queue_.Wake();
  thread_.join();
  running_ = false;
  autotune_.Stop();
  std::lock_guard<std::mutex> tl(timeline_mutex_);
  timeline_.Stop();
  return Status::OK();
}

Status Core::StartTimeline(const std::string& path, bool mark_cycles) {
  Status s = CheckRunning();
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> tl(timeline_mutex_);
  if (topo_.rank != 0) return Status::OK();
  return timeline_.Start(path, mark_cycles);
}

Status Core::StopTimeline() {
  Status s = CheckRunning();
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> tl(timeline_mutex_);
  timeline_.Stop();
  return Status::OK();
}

// ---------------------------------------------------------------- enqueue (any thread)

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
  if (t.device != -1) {
    return InvalidArgument(who() + ": device tensors (device " + std::to_string(t.device) +
                           ") are not supported by this build yet; only host memory");
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
  return Submit(tensors, n, group, false, out);
}

Status Core::ProcessSet(int32_t id, std::shared_ptr<const ProcessSetMembers>* out) const {
  *out = sets_.Members(id);
  if (*out) return Status::OK();
  return InvalidArgument("process set " + std::to_string(id) +
                         " does not exist (add it with add_process_set first)");
}

Status Core::Submit(const hvdlite_tensor_t* tensors, int32_t n, bool group, bool table_change,
                    hvdlite_handle_t* out) {
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
    e.enqueued = now;
    entries.push_back(std::move(e));
  }
  std::vector<hvdlite_handle_t> created;
  for (auto& e : entries) {
    e.handle = handles_.Create();
    created.push_back(e.handle);
  }
  s = queue_.Add(std::move(entries));
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

// ------------------------------------------------------------ process-set table

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

// ------------------------------------------------------------ background thread

void Core::TakeRefusals() {
  std::vector<Request> taken;
  {
    std::lock_guard<std::mutex> lock(refusals_mutex_);
    taken.swap(refusals_);
  }
  for (Request& q : taken) {
    // A set removed since the refusal has no op of that name left to fail.
    ProcessSetState* set = sets_.Find(q.process_set);
    if (set && set->included()) set->Refuse(std::move(q));
  }
}

void ProcessSetState::Refuse(Request q) {
  int64_t slot = -1;
  if (cache_ && cache_->Find(q, &slot) != ResponseCache::Lookup::kMiss) invalid_slots_.insert(slot);
  uncached_.push_back(std::move(q));
}

void Core::EndLoop(const Status& s) {
  std::lock_guard<std::mutex> lock(end_mutex_);
  end_status_ = s;
}

void Core::FailEverything(const Status& s) {
  for (hvdlite_handle_t h : queue_.TakeAll()) handles_.Complete(h, s);
}

void Core::Loop() {
  auto last_start = Clock::now();
  Status end = Status(HVDLITE_ERR_SHUTDOWN, "hvdlite was shut down");
  // With nothing in flight on this rank there is nothing to negotiate, so the loop
  // waits for this rank's next request (which wakes it at once) and joins the
  // coordination only every kIdleCycle, to hear of a peer's shutdown. Idle cycles at
  // the cycle time would cost CPU and, worse, a peer whose first request meets our
  // idle coordination round (its bit set, ours not yet) would wait a whole cycle.
  while (true) {
    // The cycle time in force (autotune may change it between cycles).
    const auto cycle = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double, std::milli>(autotune_.knobs().cycle_time_ms));
    const auto idle_cycle = std::max<Clock::duration>(cycle, kIdleCycle);
    bool idle = queue_.Size() == 0 && !HasRefusals() && Clock::now() - elsewhere_heard_ > kElsewhereLinger;
    for (ProcessSetState* set = sets_.NextMember(-1); set && idle; set = sets_.NextMember(set->id())) {
      idle = !set->Busy();
    }
    if (queue_.WaitForWork(last_start + (idle ? idle_cycle : cycle)) && cycle.count() > 0) {
      // Requests arrived: the rest of a burst (a training step's gradients, a loop of
      // submissions) joins them, so that one cycle negotiates and fuses them all
      // instead of a cycle starting for the first alone while the others queue.
      // HVDLITE_CYCLE_TIME=0 asks for no waiting at all.
      queue_.WaitForQuiet(kQuiet, Clock::now() + cycle, handles_.blocked());
    }
    last_start = Clock::now();
    Status s;
    bool go_on = true;
    try {
      go_on = RunCycle();
    } catch (const std::exception& ex) {
      s = Status(HVDLITE_ERR_INTERNAL, std::string("internal error in the background loop: ") + ex.what());
    }
    if (!go_on) {
      std::lock_guard<std::mutex> lock(end_mutex_);
      if (!end_status_.ok()) s = end_status_;
    }
    if (!s.ok()) {
      HVDLITE_LOG(ERROR) << s.message();
      end = s;
      break;
    }
    if (!go_on) break;
  }
  bool transport_ok = end.code() == HVDLITE_ERR_SHUTDOWN;
  {
    std::lock_guard<std::mutex> lock(end_mutex_);
    end_status_ = end;
    loop_ended_ = true;
    FailEverything(end);
  }
  // Closing may wait in MPI for peers that are still training.
  LeaveRealtime();
  sets_.Clear(transport_ok);
}

bool Core::RunCycle() {
  counters_.cycles++;
  timeline_.MarkCycle();
  const auto now = Clock::now();
  // One value for every set this cycle: all ranks then stop after the same cycle (each
  // hears of it in set 0's round at the latest). The ops in flight are counted before
  // the pop, like the idle test of Loop.
  RoundFlags mine;
  mine.shutdown = shutdown_requested_;
  queue_.CountBySet(&in_flight_, &in_flight_by_set_);
  TakeRefusals();  // ahead of this cycle's requests: a retry of the name comes after
  queue_.PopPending(&fresh_);
  Distribute();
  RoundFlags heard;
  const int64_t bytes_before = counters_.bytes;
  for (ProcessSetState* set = sets_.NextMember(-1); set; set = sets_.NextMember(set->id())) {
    auto here = in_flight_by_set_.find(set->id());
    mine.elsewhere = in_flight_ > (here == in_flight_by_set_.end() ? 0 : here->second);
    if (!set->RunCycle(now, mine, &heard)) return false;
  }
  autotune_.EndCycle(Clock::now(), counters_.bytes - bytes_before);
  if (heard.elsewhere) elsewhere_heard_ = now;
  return !heard.shutdown;
}

void Core::Distribute() {
  for (TensorEntry* e : fresh_) {
    ProcessSetState* set = sets_.Find(e->request.process_set);
    if (set && set->included()) {
      set->Accept(e);
      continue;
    }
    // Removed between its enqueue and this cycle.
    hvdlite_handle_t h = e->handle;
    std::string name = e->request.name;
    queue_.Remove(name);
    counters_.errors++;
    handles_.Complete(h, InvalidArgument("tensor '" + name + "': process set " +
                                         std::to_string(e->request.process_set) +
                                         " was removed before the op could run"));
  }
}

bool ProcessSetState::EndLoop(const Status& s) {
  end_loop_(s);
  failed_ = true;
  return false;
}

bool ProcessSetState::RunCycle(Clock::time_point now, const RoundFlags& mine, RoundFlags* heard) {
  SortFresh(now);
  bool any_uncached = false;
  std::vector<Response> ready;
  if (!Coordinate(now, mine, &any_uncached, heard, &ready)) return false;
  if (any_uncached && !Negotiate(now, &ready)) return false;
  Execute(ready);
  return !failed_;
}

void ProcessSetState::SortFresh(Clock::time_point now) {
  const bool tl = timeline_.active();
  std::vector<const std::string*> cached_names;  // timeline: rank 0 ready, cache path
  if (tl) {
    // Every fresh request opens its negotiation: one timeline event per kind of op.
    std::vector<const std::string*> names;
    for (int32_t op = 0; op < HVDLITE_OP_JOIN; ++op) {
      names.clear();
      for (const TensorEntry* e : fresh_) {
        if (e->request.op == op) names.push_back(&e->request.name);
      }
      timeline_.BeginNegotiationAll(names, kNegotiateActivity[op]);
    }
  }
  for (const TensorEntry* e : fresh_) {
    const Request& q = e->request;
    if (q.op == HVDLITE_OP_JOIN) local_joined_ = true;
    int64_t slot = -1;
    auto lookup = ResponseCache::Lookup::kMiss;
    if (cache_ && !join_active_ && q.group.empty() && q.op != HVDLITE_OP_JOIN &&
        q.op != HVDLITE_OP_BARRIER && q.op < HVDLITE_OP_ADD_PROCESS_SET) {
      lookup = cache_->Find(q, &slot);
    }
    if (lookup == ResponseCache::Lookup::kHit) {
      // Cached: the other ranks' readiness reaches rank 0 only as one "all ranks
      // ready" bit, marked when the bit vector comes back.
      if (tl) cached_names.push_back(&q.name);
      cached_pending_[slot] = now;
      continue;
    }
    if (lookup == ResponseCache::Lookup::kChanged) invalid_slots_.insert(slot);
    uncached_.push_back(q);
  }
  fresh_.clear();
  timeline_.InstantAll(cached_names, "rank 0 ready", "\"cached\": true");
  // A cached tensor waiting long on this rank goes back through the coordinator,
  // which can tell who is missing (a bit vector cannot).
  double stall_s = config_.stall_check_s;
  if (config_.stall_shutdown_s > 0 && (stall_s <= 0 || config_.stall_shutdown_s < stall_s)) {
    stall_s = config_.stall_shutdown_s;
  }
  if (stall_s > 0) {
    for (auto& kv : cached_pending_) {
      if (std::chrono::duration<double>(now - kv.second).count() > stall_s / 2) {
        invalid_slots_.insert(kv.first);
      }
    }
  }
}

bool ProcessSetState::Coordinate(Clock::time_point now, const RoundFlags& mine, bool* any_uncached,
                                 RoundFlags* heard, std::vector<Response>* ready) {
  const size_t words = cache_ ? (cache_->capacity() + 63) / 64 : 0;
  // The global set's round also carries rank 0's autotune decision (autotune.h says why).
  const size_t tuned = id() == 0 ? autotune_.Words() : 0;
  std::vector<uint64_t> bits(1 + 2 * words + tuned, 0);
  uint64_t flags = 0;
  bool wants_round = controller_ && controller_->WantsRound(now);
  if (!uncached_.empty() || wants_round) flags |= 1;
  if (mine.shutdown) flags |= 2;
  if (local_joined_) flags |= 4;
  if (mine.elsewhere) flags |= 8;
  // BAND over inverted flags is an OR over ranks.
  bits[0] = ~flags;
  for (auto& kv : cached_pending_) {
    if (!invalid_slots_.count(kv.first)) bits[1 + kv.first / 64] |= 1ull << (kv.first % 64);
  }
  for (size_t i = 0; i < words; ++i) bits[1 + words + i] = ~0ull;
  for (int64_t slot : invalid_slots_) bits[1 + words + slot / 64] &= ~(1ull << (slot % 64));
  invalid_slots_.clear();
  if (tuned) autotune_.Publish(&bits[1 + 2 * words]);

  Status s = mpi_->AndBits(&bits);
  if (!s.ok()) return EndLoop(s);
  if (tuned) autotune_.Adopt(&bits[1 + 2 * words], now);
  flags = ~bits[0];
  bool any_joined = flags & 4;
  *any_uncached = flags & 1;
  if (flags & 2) heard->shutdown = true;
  if (flags & 8) heard->elsewhere = true;

  auto to_uncached = [&](int64_t slot) {
    const Response& r = cache_->Get(slot);
    TensorEntry* e = queue_.Find(r.name);
    if (e) uncached_.push_back(e->request);
    cached_pending_.erase(slot);
  };
  for (size_t w = 0; w < words; ++w) {
    uint64_t invalid = ~bits[1 + words + w];
    while (invalid) {
      int64_t slot = static_cast<int64_t>(w * 64 + __builtin_ctzll(invalid));
      invalid &= invalid - 1;
      if (!cache_->Has(slot)) continue;
      if (cached_pending_.count(slot)) to_uncached(slot);
      cache_->Erase(slot);
    }
  }
  join_active_ = any_joined;
  if (any_joined) {
    while (!cached_pending_.empty()) to_uncached(cached_pending_.begin()->first);
  }

  for (size_t w = 0; w < words; ++w) {
    uint64_t hit = bits[1 + w];
    while (hit) {
      int64_t slot = static_cast<int64_t>(w * 64 + __builtin_ctzll(hit));
      hit &= hit - 1;
      if (!cache_->Has(slot) || !cached_pending_.count(slot)) continue;
      cache_->Touch(slot);
      ready->push_back(cache_->Get(slot));
      cached_pending_.erase(slot);
      counters_.cache_hits++;
    }
  }
  if (timeline_.active() && !ready->empty()) {
    std::vector<const std::string*> cached_names;
    for (const Response& r : *ready) cached_names.push_back(&r.name);
    timeline_.InstantAll(cached_names, "all ranks ready", "\"cached\": true");
  }
  return true;
}

bool ProcessSetState::Negotiate(Clock::time_point now, std::vector<Response>* ready) {
  counters_.coordinator_gathers++;
  counters_.cache_misses += static_cast<int64_t>(uncached_.size());
  for (Request& q : uncached_) {
    TensorEntry* e = queue_.Find(q.name);
    q.wait_ms = e ? std::chrono::duration_cast<std::chrono::milliseconds>(now - e->enqueued).count() : 0;
  }
  std::vector<uint8_t> mine;
  SerializeRequests(uncached_, &mine);
  uncached_.clear();
  std::vector<std::vector<uint8_t>> all;
  Status s = mpi_->GatherBlobs(mine, &all);
  std::vector<uint8_t> blob;
  if (s.ok() && controller_) {
    for (size_t r = 0; r < all.size() && s.ok(); ++r) {
      std::vector<Request> reqs;
      s = ParseRequests(all[r].data(), all[r].size(), &reqs);
      for (const Request& q : reqs) {
        if (timeline_.active() && q.op != HVDLITE_OP_JOIN && q.refusal.empty()) {
          timeline_.BeginNegotiation(q.name, kNegotiateActivity[q.op]);
          timeline_.Instant(q.name, "rank " + std::to_string(q.rank) + " ready");
        }
        controller_->AddRequest(q, now);
      }
    }
    SerializeResponses(controller_->BuildResponses(now), &blob);
  }
  if (s.ok()) s = mpi_->BroadcastBlob(&blob);
  std::vector<Response> fresh_responses;
  if (s.ok()) s = ParseResponses(blob.data(), blob.size(), &fresh_responses);
  if (!s.ok()) return EndLoop(s);
  for (Response& r : fresh_responses) {
    if (r.cacheable && cache_ && r.error.empty()) {
      // Every rank submitted a cacheable tensor, so each has its own request here;
      // Put runs on every rank in this same order, keeping slots identical.
      TensorEntry* e = queue_.Find(r.name);
      Request local = e ? e->request : Request();
      if (!e) local.name = r.name;
      cache_->Put(local, r);
    }
    ready->push_back(std::move(r));
  }
  return true;
}

void ProcessSetState::Finish(TensorEntry* e, const Status& s, OpOutput out) {
  if (!e) return;
  hvdlite_handle_t h = e->handle;
  queue_.Remove(e->request.name);  // e is gone from here on
  if (s.ok()) {
    counters_.tensors++;
  } else {
    counters_.errors++;
  }
  handles_.Complete(h, s, std::move(out));
}

void ProcessSetState::FinishAll(const std::vector<TensorEntry*>& entries, const Status& s) {
  std::vector<hvdlite_handle_t> handles = queue_.RemoveAll(entries);  // entries gone
  (s.ok() ? counters_.tensors : counters_.errors) += static_cast<int64_t>(handles.size());
  handles_.CompleteAll(handles, s);
}

void ProcessSetState::Execute(const std::vector<Response>& ready) {
  // Plan: ready[begin, ends[n]) is one collective, a run of compatible allreduces fused
  // under the threshold or one other response. Every field used here comes from the
  // responses, which are identical on all ranks, and the threshold in force (autotune
  // changes it only between cycles, on every rank alike).
  const int64_t threshold = autotune_.knobs().fusion_threshold;
  // Through shared memory (flat or hierarchical) an allreduce reads its tensors in
  // place, so large ones fuse for free and save a round each; over MPI alone they go by
  // themselves (the fusion buffer's copies would cost more than the round).
  const int64_t fuse_alone_bytes =
      mpi_->shared_memory() || Hierarchical() ? std::numeric_limits<int64_t>::max() : kFuseAloneBytes;
  std::vector<size_t> ends;
  for (size_t i = 0; i < ready.size();) {
    const Response& r = ready[i];
    size_t j = i + 1;
    int64_t bytes = NumElements(r.shape) * ElementSize(r.dtype);
    if (r.op == HVDLITE_OP_ALLGATHER && r.error.empty()) {
      // Allgathers fuse by bytes alone: every rank's pieces travel in one Allgatherv.
      int64_t gathered = AllgatherBytes(r);
      while (threshold > 0 && gathered < kFuseAloneBytes && j < ready.size()) {
        const Response& c = ready[j];
        if (c.op != HVDLITE_OP_ALLGATHER || !c.error.empty()) break;
        int64_t b = AllgatherBytes(c);
        if (b >= kFuseAloneBytes || gathered + b > threshold) break;
        gathered += b;
        ++j;
      }
    } else if (r.op == HVDLITE_OP_ALLREDUCE && r.error.empty() && bytes < fuse_alone_bytes) {
      while (threshold > 0 && j < ready.size()) {
        const Response& c = ready[j];
        int64_t b = NumElements(c.shape) * ElementSize(c.dtype);
        if (c.op != HVDLITE_OP_ALLREDUCE || !c.error.empty() || b >= fuse_alone_bytes || c.dtype != r.dtype ||
            c.reduce_op != r.reduce_op || !SameFactor(c.prescale, r.prescale) ||
            !SameFactor(c.postscale, r.postscale) ||
            c.contributors != r.contributors || bytes + b > threshold) {
          break;
        }
        bytes += b;
        ++j;
      }
    }
    ends.push_back(j);
    i = j;
  }
  if (timeline_.active()) {
    // Negotiation ends for the whole list at once; the time a tensor then waits for the
    // collectives ahead of it is its QUEUE activity, ended when its own one starts.
    size_t begin = 0;
    std::vector<const std::string*> names;
    for (size_t end : ends) {
      names.clear();
      for (size_t k = begin; k < end; ++k) {
        if (ready[k].op != HVDLITE_OP_JOIN) names.push_back(&ready[k].name);
      }
      timeline_.EndAll(names);
      if (ready[begin].error.empty() && !names.empty()) {
        // A collective's ops are of one kind: one call for them all.
        const size_t fused = end - begin;
        std::vector<const Response*> ops;
        for (size_t k = begin; k < end; ++k) {
          if (ready[k].op != HVDLITE_OP_JOIN) ops.push_back(&ready[k]);
        }
        timeline_.BeginOps(
            names, kOpActivity[ops[0]->op],
            [&](size_t n) { return TimelineArgsKey(*ops[n], fused); },
            [&](size_t n) { return TimelineArgs(*ops[n], fused, rank_, size_); });
      }
      begin = end;
    }
    queue_start_us_ = Timeline::Now();
  }
  size_t i = 0;
  for (size_t end : ends) {
    const Response& r = ready[i];
    if (!r.error.empty()) {
      // An error for some ranks only (a late submission of a refused tensor) leaves
      // the others' entries of that name alone: theirs may be a later op of it.
      if (r.targets.empty() || r.targets[rank_]) Finish(queue_.Find(r.name), Status(r.error_code, r.error));
    } else if (r.op == HVDLITE_OP_ALLGATHER && end - i > 1) {
      std::vector<const Response*> fused;
      for (size_t k = i; k < end; ++k) fused.push_back(&ready[k]);
      ExecuteAllgather(fused);
    } else if (r.op != HVDLITE_OP_ALLREDUCE) {
      ExecuteOne(r);
    } else {
      std::vector<const Response*> fused;
      for (size_t k = i; k < end; ++k) fused.push_back(&ready[k]);
      ExecuteAllreduce(fused);
    }
    i = end;
  }
}

LayeredAllreduce* ProcessSetState::Hierarchical() const {
  return autotune_.knobs().hierarchical ? mpi_->hierarchical() : nullptr;
}

void ProcessSetState::ExecuteAllreduce(const std::vector<const Response*>& fused) {
  const Response& first = *fused[0];
  const int32_t dtype = first.dtype;
  const int elem = ElementSize(dtype);
  const bool average = first.reduce_op == HVDLITE_AVERAGE;
  const int64_t divisor = average ? std::max(1, first.contributors) : 1;
  const int32_t mpi_op = average ? HVDLITE_SUM : first.reduce_op;
  const bool tl = timeline_.active();
  std::vector<TensorEntry*> entries =
      queue_.FindAll(fused, [](const Response* r) -> const std::string& { return r->name; });
  std::vector<const std::string*> names;  // timeline tracks
  int64_t total = 0;
  for (const Response* r : fused) {
    total += NumElements(r->shape);
    if (tl) names.push_back(&r->name);
  }
  Activities activities(timeline_, names, queue_start_us_);
  activities.Done("QUEUE");
  Status s;
  LayeredAllreduce* hierarchical = Hierarchical();
  if (mpi_->shared_memory() || hierarchical) {
    // Straight from the inputs through shared memory into the outputs, scaled on the
    // way: no fusion buffer and no separate scaling pass.
    std::vector<ShmAllreduce::Piece> pieces;
    pieces.reserve(fused.size());
    for (size_t k = 0; k < fused.size(); ++k) {
      TensorEntry* e = entries[k];  // null: this rank joined and contributes zeros
      pieces.push_back({e ? e->input : nullptr, e ? e->output : nullptr, NumElements(fused[k]->shape)});
    }
    if (hierarchical) {
      // The plan's steps over the topology layers (hierarchical_allreduce.h).
      s = hierarchical->Allreduce(pieces, dtype, mpi_op, first.prescale, first.postscale, divisor,
                                  [&](const char* step) { activities.Done(step); });
    } else {
      mpi_->SetShmChunkBytes(autotune_.knobs().shm_chunk_bytes);
      s = mpi_->SharedAllreduce(pieces, dtype, mpi_op, first.prescale, first.postscale, divisor);
      activities.Done("SHM_ALLREDUCE");
    }
  } else if (fused.size() == 1 && entries[0]) {
    // One tensor: reduce in its output buffer, no fusion-buffer round trip.
    TensorEntry* e = entries[0];
    // Unscaled input goes to MPI as the send buffer: no copy at all.
    const void* send = e->input;
    if (first.prescale != 1.0) {
      ScaledCopy(e->output, e->input, total, dtype, first.prescale, 1);
      send = e->output;
    }
    activities.Done("MEMCPY_IN_FUSION_BUFFER");
    s = mpi_->Allreduce(send, e->output, total, dtype, mpi_op);
    activities.Done("MPI_ALLREDUCE");
    if (s.ok()) ScaledCopy(e->output, e->output, total, dtype, first.postscale, divisor);
    activities.Done("MEMCPY_OUT_FUSION_BUFFER");
  } else {
    uint8_t* buf = fusion_.Get(total * elem);
    int64_t off = 0;
    for (size_t k = 0; k < fused.size(); ++k) {
      int64_t n = NumElements(fused[k]->shape);
      if (entries[k]) {
        ScaledCopy(buf + off * elem, entries[k]->input, n, dtype, first.prescale, 1);
      } else {
        std::memset(buf + off * elem, 0, n * elem);  // a joined rank contributes zeros
      }
      off += n;
    }
    activities.Done("MEMCPY_IN_FUSION_BUFFER");
    s = mpi_->Allreduce(buf, buf, total, dtype, mpi_op);
    activities.Done("MPI_ALLREDUCE");
    off = 0;
    for (size_t k = 0; k < fused.size() && s.ok(); ++k) {
      int64_t n = NumElements(fused[k]->shape);
      if (entries[k]) ScaledCopy(entries[k]->output, buf + off * elem, n, dtype, first.postscale, divisor);
      off += n;
    }
    activities.Done("MEMCPY_OUT_FUSION_BUFFER");
  }
  if (tl) timeline_.EndAll(names);  // ALLREDUCE
  counters_.collectives++;
  if (mpi_->shared_memory()) counters_.shm_collectives++;
  if (hierarchical) counters_.hierarchical_collectives++;
  if (fused.size() > 1) counters_.fused_collectives++;
  counters_.bytes += total * elem;
  counters_.wire_bytes += WireBytes(HVDLITE_OP_ALLREDUCE, total * elem, size_);
  FinishAll(entries, s);
  if (!s.ok()) EndLoop(s);
}

// Bytes of one allgather's result (all ranks' rows).
int64_t ProcessSetState::AllgatherBytes(const Response& r) {
  int64_t rows = 0;
  for (int64_t d : r.first_dims) rows += d;
  return rows * RowElements(r.shape) * ElementSize(r.dtype);
}

// Several allgathers in one Allgatherv: each rank sends its tensors' rows back to back,
// so rank k's block holds, per tensor in order, first_dims[k] rows of it.
void ProcessSetState::ExecuteAllgather(const std::vector<const Response*>& fused) {
  const int size = size_, me = rank_;
  const bool tl = timeline_.active();
  std::vector<const std::string*> names;
  std::vector<TensorEntry*> entries;
  std::vector<int64_t> row_bytes;
  std::vector<int64_t> block(size, 0);  // bytes each rank contributes
  for (const Response* r : fused) {
    entries.push_back(queue_.Find(r->name));
    row_bytes.push_back(RowElements(r->shape) * ElementSize(r->dtype));
    for (int k = 0; k < size; ++k) block[k] += r->first_dims[k] * row_bytes.back();
    if (tl) names.push_back(&r->name);
  }
  int64_t total = 0;
  for (int64_t b : block) total += b;
  Activities activities(timeline_, names, queue_start_us_);
  activities.Done("QUEUE");
  uint8_t* buf = fusion_.Get(block[me] + total);
  uint8_t* send = buf;
  uint8_t* recv = buf + block[me];
  int64_t off = 0;
  for (size_t t = 0; t < fused.size(); ++t) {
    int64_t n = fused[t]->first_dims[me] * row_bytes[t];
    if (entries[t] && n > 0) std::memcpy(send + off, entries[t]->input, n);
    off += n;
  }
  activities.Done("MEMCPY_IN_FUSION_BUFFER");
  Status s = mpi_->Allgatherv(send, block[me], recv, block);
  activities.Done("MPI_ALLGATHER");
  if (mpi_->hierarchical_allgather()) counters_.hierarchical_collectives++;
  std::vector<OpOutput> outs(fused.size());
  if (s.ok()) {
    for (size_t t = 0; t < fused.size(); ++t) outs[t].Allocate(AllgatherBytes(*fused[t]));
    int64_t at = 0;  // walks the received blocks in rank order
    for (int k = 0; k < size; ++k) {
      for (size_t t = 0; t < fused.size(); ++t) {
        int64_t n = fused[t]->first_dims[k] * row_bytes[t];
        if (n > 0) std::memcpy(outs[t].data.get() + outs[t].first_dim * row_bytes[t], recv + at, n);
        outs[t].first_dim += fused[t]->first_dims[k];
        at += n;
      }
    }
  }
  activities.Done("MEMCPY_OUT_FUSION_BUFFER");
  if (tl) timeline_.EndAll(names);  // ALLGATHER
  counters_.collectives++;
  counters_.fused_collectives++;
  counters_.bytes += total;
  counters_.wire_bytes += WireBytes(HVDLITE_OP_ALLGATHER, total, size);
  for (size_t t = 0; t < fused.size(); ++t) Finish(entries[t], s, std::move(outs[t]));
  if (!s.ok()) EndLoop(s);
}

void ProcessSetState::ExecuteOne(const Response& r) {
  TensorEntry* e = r.op == HVDLITE_OP_JOIN ? queue_.Find(kJoinName) : queue_.Find(r.name);
  const int elem = ElementSize(r.dtype);
  const int size = size_, me = rank_;
  const bool tl = timeline_.active() && r.op != HVDLITE_OP_JOIN;
  std::vector<const std::string*> names;
  if (tl) names.push_back(&r.name);
  Activities activities(timeline_, names, queue_start_us_);
  activities.Done("QUEUE");
  Status s;
  OpOutput out;
  int64_t moved = 0;
  int64_t sent_away = -1;  // alltoall: the rows this rank sent to the others
  switch (r.op) {
    case HVDLITE_OP_ALLGATHER: {
      int64_t row = RowElements(r.shape) * elem;
      std::vector<int64_t> bytes(size);
      int64_t total = 0;
      for (int k = 0; k < size; ++k) {
        bytes[k] = r.first_dims[k] * row;
        total += bytes[k];
        out.first_dim += r.first_dims[k];
      }
      out.Allocate(total);
      s = mpi_->Allgatherv(e ? e->input : nullptr, bytes[me], out.data.get(), bytes);
      moved = total;
      if (mpi_->hierarchical_allgather()) counters_.hierarchical_collectives++;
      break;
    }
    case HVDLITE_OP_BROADCAST: {
      int64_t nbytes = NumElements(r.shape) * elem;
      void* target = e ? e->output : fusion_.Get(nbytes);  // a joined rank receives and drops
      if (me == r.root_rank && e && e->output != e->input && nbytes > 0) {
        std::memcpy(e->output, e->input, nbytes);
      }
      s = mpi_->Bcast(target, nbytes, r.root_rank);
      moved = nbytes;
      if (mpi_->hierarchical_broadcast()) counters_.hierarchical_collectives++;
      break;
    }
    case HVDLITE_OP_ALLTOALL: {
      int64_t row = RowElements(r.shape) * elem;
      std::vector<int64_t> send(size), recv(size);
      int64_t total = 0;
      out.recv_splits.resize(size);
      for (int k = 0; k < size; ++k) {
        send[k] = r.splits[static_cast<size_t>(me) * size + k] * row;
        out.recv_splits[k] = r.splits[static_cast<size_t>(k) * size + me];
        recv[k] = out.recv_splits[k] * row;
        out.first_dim += out.recv_splits[k];
        total += recv[k];
      }
      out.Allocate(total);
      s = mpi_->Alltoallv(e ? e->input : nullptr, send, out.data.get(), recv);
      moved = total;
      sent_away = 0;
      for (int k = 0; k < size; ++k) sent_away += k == me ? 0 : send[k];
      break;
    }
    case HVDLITE_OP_REDUCESCATTER: {
      int64_t rows = r.shape[0], row = RowElements(r.shape);
      std::vector<int64_t> counts(size);
      for (int k = 0; k < size; ++k) counts[k] = (rows / size + (k < rows % size ? 1 : 0)) * row;
      int64_t total = rows * row;
      const void* in = e->input;
      // MPI forbids aliased buffers: an in-place (or overlapping) call reduces a copy.
      auto in_at = reinterpret_cast<uintptr_t>(e->input);
      auto out_at = reinterpret_cast<uintptr_t>(e->output);
      bool overlap = total > 0 && counts[me] > 0 && out_at < in_at + total * elem &&
                     in_at < out_at + counts[me] * elem;
      if (r.prescale != 1.0 || overlap) {
        uint8_t* scratch = fusion_.Get(total * elem);
        ScaledCopy(scratch, e->input, total, r.dtype, r.prescale, 1);
        in = scratch;
      }
      bool average = r.reduce_op == HVDLITE_AVERAGE;
      s = mpi_->ReduceScatter(in, e->output, counts, r.dtype, average ? HVDLITE_SUM : r.reduce_op);
      if (s.ok()) {
        ScaledCopy(e->output, e->output, counts[me], r.dtype, r.postscale,
                   average ? std::max(1, r.contributors) : 1);
      }
      moved = total * elem;
      break;
    }
    case HVDLITE_OP_BARRIER:
      s = mpi_->Barrier();
      break;
    case HVDLITE_OP_JOIN:
      local_joined_ = false;
      out.first_dim = r.last_joined_rank;
      break;
    case HVDLITE_OP_ADD_PROCESS_SET:
      s = AddSet(r, &out);
      break;
    case HVDLITE_OP_REMOVE_PROCESS_SET:
      s = RemoveSet(r);
      break;
  }
  if (tl) {
    activities.Done(kCollectiveActivity[r.op]);
    timeline_.End(r.name);
  }
  if (r.op != HVDLITE_OP_JOIN) {
    counters_.collectives++;
    counters_.bytes += moved;
    counters_.wire_bytes += sent_away >= 0 ? sent_away : WireBytes(r.op, moved, size);
  }
  Finish(e, s, std::move(out));
  if (!s.ok()) EndLoop(s);
}

}  // namespace hvdlite
