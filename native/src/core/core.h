// The process-wide core: init/shutdown (core.cc), the enqueue entry point (enqueue.cc),
// the process-set table's changes and refusals (process_set_changes.cc), and the
// background thread that runs the cycle (pop -> coordinate -> negotiate -> execute ->
// complete) for every process set (loop.cc; cycle/ holds each set's round).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "cycle/process_set.h"

namespace hvdlite {

// The process: init/shutdown, enqueue and the process-set table for framework threads,
// and the background thread that runs the cycle over every process set.
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
  // Enqueue of one tensor whose caller then waits for it at once (a blocking op):
  // *op_status is Wait's (and release as Wait's). Where it can, the caller runs the
  // op's cycle itself (RunCallerCycle); else the background thread runs it, at once
  // (the caller counts as blocked from before the enqueue, so no burst is gathered).
  Status EnqueueAndWait(const hvdlite_tensor_t* tensor, double timeout_s, bool release,
                        hvdlite_handle_t* out, Status* op_status);
  // HandleTable::Wait of op h (hvdlite_wait), whose caller first runs h's cycle itself
  // where EnqueueAndWait's would, if h is its rank's only op, not yet in a cycle, of at
  // most CallerCycleBytes of host memory: a synchronize right after an async call.
  Status Wait(hvdlite_handle_t h, double timeout_s, bool release);
  // Sends a refusal of the op named name to the coordinator (see hvdlite_refuse).
  Status Refuse(int32_t op, const char* name, int32_t process_set, const std::string& reason);
  // join()'s caller gave up: see hvdlite_leave_join. Goes with the refusals (a request
  // made outside the queue) to the global set.
  Status LeaveJoin();
  HandleTable& handles() { return handles_; }
  const Counters& counters() const { return counters_; }
  const Autotuner& autotune() const { return autotune_; }
  Status StartTimeline(const std::string& path, bool mark_cycles);
  Status StopTimeline();
  // Process sets (see c_api.h): the changes are collective over all ranks and block.
  Status AddProcessSet(const int32_t* ranks, int32_t n, int32_t* id);
  Status RemoveProcessSet(int32_t id);
  // The members of set id; an error naming the id when there is none.
  Status ProcessSet(int32_t id, std::shared_ptr<const ProcessSetMembers>* out) const;
  std::vector<std::shared_ptr<const ProcessSetMembers>> ProcessSets() const { return sets_.All(); }

 private:
  Status Validate(const hvdlite_tensor_t& t, int64_t index, const ProcessSetMembers& set) const;
  // Enqueue, for the public ops or (table_change) the process-set changes.
  // wake: wake the background thread (not when the caller runs the cycle itself).
  Status Submit(const hvdlite_tensor_t* tensors, int32_t n, bool group, bool table_change,
                hvdlite_handle_t* out, bool wake = true);
  // Submits one table change (op, with shape as its argument) and waits for it; *result
  // receives the handle's first_dim.
  Status ChangeTable(int32_t op, const std::vector<int64_t>& argument, int64_t* result);

  // Background thread.
  void Loop();
  // One cycle, by whoever holds cycle_mutex_; pop: take every pending request (the
  // background thread's cycles), else only those already in fresh_ (a caller's). False
  // when the loop must end, *s saying why if not a shutdown.
  bool RunCycle(bool pop, Status* s);
  bool RunCycleUnguarded(bool pop);  // RunCycle's body: may throw
  // A thread blocked on op h, holding cycle_mutex_, whose request it popped alone
  // (popped: EnqueueAndWait's TensorQueue::PopAlone of an op just enqueued without
  // waking the background thread, or Wait's PopOnly of its rank's only op): runs one
  // cycle itself, which can then only run h (CallerCycleBytes says where it may). Two
  // task switches less per blocking call: the wake of the background thread and the
  // wake of the caller (docs/performance.md). Where the cycle calls MPI (across hosts)
  // it runs with an escape armed (CycleEscape, transport/mpi_fault_guard.h). Gives the
  // token up: back, or for good where the cycle was left by its escape (a fault inside
  // MPI, lost peers), so that no cycle runs again on MPI in whatever state the fault left
  // it; the background thread then ends the loop (TakeCycleToken), failing the ops. If h
  // is not done (or was not popped), the background thread is woken to go on with it.
  void RunCallerCycle(std::unique_lock<std::timed_mutex>* token, hvdlite_handle_t h, bool popped);
  // The background thread takes the cycle token; false (without it) once a caller's
  // cycle was left by its escape, which keeps the token for good: the loop then ends,
  // failing the ops, instead of waiting for it (and Shutdown's join with it).
  bool TakeCycleToken(std::unique_lock<std::timed_mutex>* token);
  // Why no cycle can run again (a cycle faulted inside MPI, or one was left by its
  // escape, with the launcher's notice if one came), after "hvdlite <doing>: " unless
  // doing is null; OK where cycles can run.
  Status CyclesStopped(const char* doing) const;
  // The largest blocking op (input bytes of host memory) whose cycle a caller holding
  // cycle_mutex_ may run as things stand (RunCallerCycle): the least of every set's
  // ProcessSetState::CallerCycleBytes; 0 where a refusal waits to be sent or the loop
  // ends.
  int64_t CallerCycleBytes();
  // Hands this cycle's new entries to their sets; fails those of a set that is gone.
  void Distribute();
  // A transport failure ends the loop after this cycle, with s as the reason.
  void EndLoop(const Status& s);
  void FailEverything(const Status& s);
  // Hands the refusals made since the last cycle to their sets (ProcessSetState::Refuse).
  void TakeRefusals();
  bool HasRefusals() {
    std::lock_guard<std::mutex> lock(refusals_mutex_);
    return !refusals_.empty();
  }

  // Where the background thread may run: on the core of the last thread that blocked
  // in EnqueueAndWait on a host tensor (loop_cpu_), or anywhere (-1) once an op is
  // enqueued without a wait or a GPU tensor comes (the thread then works beside the
  // training threads; threads CUDA and NCCL start from it inherit its cores). Any
  // thread; changes under place_mutex_, which also guards loop_tid_ (0 once the loop
  // thread has ended). Only for a rank that shares its 2 cores or more with no other
  // (follow_caller_, set at init from MpiTopology::sharing): there a wake elsewhere
  // finds an idle core. Where ranks keep their cores busy a wake finds a busy core anyway (2 ranks on 2 cores:
  // no gain, allgather of 64 KiB 59 -> 79 us), and two real-time threads held on one
  // core would not share it; never with HVDLITE_BIND_TO=core (the rank's share binds it).
  void PlaceLoop(int cpu);
  std::atomic<int> loop_cpu_{-1};
  std::atomic<bool> follow_caller_{false};
  std::mutex place_mutex_;
  int loop_tid_ = 0;

  // Set before the thread starts or while it is not running; read-only otherwise.
  Config config_;
  MpiTopology topo_;
  std::thread thread_;
  std::atomic<bool> running_{false};
  std::atomic<bool> shutdown_requested_{false};
  std::atomic<bool> loop_ended_{false};
  std::atomic<bool> loop_returned_{false};  // the thread left Loop (and closed its sets)
  // The GPU of the first device tensor enqueued (-1: none yet). One per process: a tensor
  // on another is refused at enqueue, where its peers hear of the refusal.
  mutable std::atomic<int> gpu_ordinal_{-1};
  std::mutex lifecycle_mutex_;  // serializes Init/Shutdown
  std::mutex end_mutex_;
  Status end_status_;           // Guarded by end_mutex_: why the loop ended.
  std::mutex change_mutex_;     // one table change at a time from this process
  int64_t changes_ = 0;         // Guarded by change_mutex_: names the next change

  HandleTable handles_;
  TensorQueue queue_;
  Counters counters_;
  std::mutex refusals_mutex_;
  std::vector<Request> refusals_;  // Guarded by refusals_mutex_: not yet sent
  Timeline timeline_;  // used by the background thread; Start/Stop under timeline_mutex_
  std::mutex timeline_mutex_;
  ProcessSetTable sets_;
  Autotuner autotune_;
  gpu::Device gpu_;  // background thread; its resources freed as the loop ends  // started by the background thread at init; View() any thread

  // The cycle token: whoever runs a cycle holds it, the background thread or a caller
  // (RunCallerCycle). The members below, and every set's state, are the holder's.
  std::timed_mutex cycle_mutex_;
  // A cycle decided that the loop ends (RunCycle returned false): no cycle runs after it;
  // cycles_end_ says why (OK: a shutdown). The background thread ends the loop.
  bool cycles_ended_ = false;
  Status cycles_end_;
  // When the last cycle started, whoever ran it: the loop's idle and cycle times count
  // from it.
  std::atomic<Clock::time_point> last_cycle_{Clock::time_point()};
  std::vector<TensorEntry*> fresh_;  // this cycle's new entries (TensorQueue::PopPending)
  int64_t in_flight_ = 0;            // this cycle's count of ops in flight, and per set
  std::map<int32_t, int64_t> in_flight_by_set_;
  Clock::time_point elsewhere_heard_;  // when RoundFlags::elsewhere was last heard
};

}  // namespace hvdlite
