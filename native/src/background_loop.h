// The process-wide core: init/shutdown, the enqueue entry point, and the background
// thread that runs the cycle (drain -> negotiate -> fuse -> execute -> complete).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "backend_mpi.h"
#include "config.h"
#include "controller.h"
#include "fusion.h"
#include "handle_table.h"
#include "response_cache.h"
#include "tensor_queue.h"
#include "timeline.h"

namespace hvdlite {

struct Counters {
  std::atomic<int64_t> cycles{0}, coordinator_gathers{0}, cache_hits{0}, cache_misses{0},
      collectives{0}, fused_collectives{0}, tensors{0}, bytes{0}, errors{0}, shm_collectives{0},
      wire_bytes{0};
};

class Core {
 public:
  static Core& Get();

  // Framework threads.
  Status Init(int64_t comm_f2c);
  Status Shutdown();
  bool initialized() const { return running_.load(); }
  Status CheckRunning() const;
  const MpiTopology& topology() const { return topo_; }
  Status Enqueue(const hvdlite_tensor_t* tensors, int32_t n, bool group, hvdlite_handle_t* out);
  HandleTable& handles() { return handles_; }
  const Counters& counters() const { return counters_; }
  Status StartTimeline(const std::string& path, bool mark_cycles);
  Status StopTimeline();

 private:
  Status Validate(const hvdlite_tensor_t& t, int64_t index) const;

  // Background thread.
  void Loop(int64_t comm_f2c);
  bool RunCycle();  // false when the loop must end
  void Execute(const std::vector<Response>& ready);
  void ExecuteAllreduce(const std::vector<const Response*>& fused);
  void ExecuteAllgather(const std::vector<const Response*>& fused);
  static int64_t AllgatherBytes(const Response& r);
  void ExecuteOne(const Response& r);
  void Finish(TensorEntry* e, const Status& s, OpOutput out = OpOutput());
  // Finish for ops without outputs of their own (a fused allreduce), in one go.
  void FinishAll(const std::vector<TensorEntry*>& entries, const Status& s);
  // A transport failure ends the loop after this cycle, with s as the reason; returns
  // false (RunCycle's "stop").
  bool EndLoop(const Status& s);
  void FailEverything(const Status& s);

  // Set before the thread starts or while it is not running; read-only otherwise.
  Config config_;
  MpiTopology topo_;
  std::thread thread_;
  std::atomic<bool> running_{false};
  std::atomic<bool> shutdown_requested_{false};
  std::atomic<bool> loop_ended_{false};
  std::mutex lifecycle_mutex_;  // serializes Init/Shutdown
  std::mutex end_mutex_;
  Status end_status_;           // Guarded by end_mutex_: why the loop ended.

  HandleTable handles_;
  TensorQueue queue_;
  Counters counters_;
  Timeline timeline_;  // used by the background thread; Start/Stop under timeline_mutex_
  std::mutex timeline_mutex_;

  // Background thread only.
  MpiBackend mpi_;
  std::unique_ptr<ResponseCache> cache_;
  std::unique_ptr<Controller> controller_;
  FusionBuffer fusion_;
  std::vector<TensorEntry*> fresh_;  // this cycle's new entries (TensorQueue::PopPending)
  std::vector<Request> uncached_;
  std::map<int64_t, Clock::time_point> cached_pending_;  // slot -> when it was enqueued
  std::set<int64_t> invalid_slots_;
  bool join_active_ = false;
  bool local_joined_ = false;
  int64_t queue_start_us_ = 0;  // timeline: when this cycle's operations began to queue
};

}  // namespace hvdlite
