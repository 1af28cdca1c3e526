// The core's lifecycle: Init starts the background thread, which brings MPI up, checks
// that the settings that must agree do, makes the global process set and runs the loop
// (loop.cc); Shutdown asks the loop to end and joins it (or leaves it to the process's
// end where it cannot return: parked by the fault guard, or lost peers). Framework threads, under
// lifecycle_mutex_.
#include "core/core.h"

#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <future>

#include "common/thread_sched.h"
#include "transport/mpi_fault_guard.h"

namespace hvdlite {
namespace {

// values holds kSettings values per rank; the one at `index` must be equal on every rank.
constexpr int kSettings = 5;
Status SameOnEveryRank(const std::vector<int64_t>& values, int index, const char* setting) {
  std::vector<std::string> per_rank;
  for (size_t r = index; r < values.size(); r += kSettings) {
    per_rank.push_back(std::to_string(values[r]));
  }
  std::string diff = Disagreement(per_rank);
  if (diff.empty()) return Status::OK();
  return InvalidArgument(std::string(setting) + " must be the same on every rank: " + diff);
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
  if (RequestRealtime(topo.sharing, &why)) {
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
  if (!running_) {
    return Status(HVDLITE_ERR_NOT_INITIALIZED, "hvdlite is not initialized: call hvdlite.init() first");
  }
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
  loop_returned_ = false;
  cycles_ended_ = false;  // no thread runs a cycle now (the last loop was joined)
  cycles_end_ = Status::OK();
  loop_cpu_ = -1;  // a new thread, anywhere
  follow_caller_ = false;
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
    {
      std::lock_guard<std::mutex> lock(place_mutex_);
      loop_tid_ = static_cast<int>(syscall(SYS_gettid));
    }
    if (st.ok()) {
      topo_ = topo;
      SetLogRank(topo.rank);
      // The GPU's stream end is polled before the wait sleeps, unless the ranks sharing
      // these cores outnumber them (one process-wide device, so one world-wide rule).
      gpu_.set_may_poll(!topo.sharing.crowded());
      if (config_.bind_to_core) BindThisRank(topo);
      follow_caller_ = !config_.bind_to_core && topo.sharing.ranks == 1 && topo.sharing.cores >= 2;
      if (topo.rank == 0 && !config_.timeline_path.empty()) {
        st = timeline_.Start(config_.timeline_path, config_.timeline_mark_cycles);
      }
      if (st.ok()) {
        st = autotune_.Start(config_.autotune, config_, topo.rank, world->shared_memory(),
                             world->layered_allreduce());
      }
      // Every rank learns whether rank 0 could open the timeline, so a bad path fails
      // init everywhere instead of leaving the others waiting for rank 0. Done
      // whatever the local config says: HVDLITE_TIMELINE may be set on rank 0 only.
      // Also every rank's settings that must agree, or the ranks would coordinate with
      // bit vectors of different lengths or plan different fusions: a hang or wrong
      // results later, a clear error now.
      const int64_t mine[kSettings] = {st.ok() ? 1 : 0, config_.cache_capacity,
                                       config_.fusion_threshold, config_.autotune.enabled ? 1 : 0,
                                       config_.gpu_stage_chunk};
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
      // Staged allreduces run one collective per chunk (gpu_execution.cc).
      if (st.ok()) st = SameOnEveryRank(all, 4, "HVDLITE_GPU_STAGE_CHUNK");
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
          CoreParts{config_, queue_, handles_, counters_, timeline_, sets_, autotune_, gpu_,
                    [this](const Status& failure) { EndLoop(failure); }})));
    }
    if (ok) MakeBackgroundRealtime(config_, topo);
    started.set_value(st);
    if (ok) Loop();
    {
      std::lock_guard<std::mutex> lock(place_mutex_);
      loop_tid_ = 0;  // gone: nothing to place any more
    }
    loop_returned_ = true;
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
  Status stopped = CyclesStopped("cannot shut down");
  if (!stopped.ok() || !thread_.joinable()) return stopped;
  shutdown_requested_ = true;
  queue_.Wake();
  // Its last cycles may fault meanwhile: a caller's escape ends the loop all the same
  // (TakeCycleToken), but a background thread parked in the fault handler never
  // returns, nor may one that waits inside MPI for peers the launcher reported lost
  // (it has no escape): either is left to the process's end rather than joined.
  while (!loop_returned_) {
    if (MpiThreadParked() || PeersLost()) {
      thread_.detach();
      Status stopped = CyclesStopped("cannot shut down");
      if (!stopped.ok()) return stopped;
      const std::string notice = LostPeersNotice();
      return Status(HVDLITE_ERR_RANK_FAILED,
                    "hvdlite cannot shut down: " + (notice.empty() ? "peers were lost" : notice) +
                        "; the background thread may wait inside MPI for them, and is left to "
                        "the process's end");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  thread_.join();
  stopped = CyclesStopped("cannot shut down");  // a cycle left by its escape meanwhile
  if (!stopped.ok()) return stopped;
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

}  // namespace hvdlite
