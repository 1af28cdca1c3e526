// Process sets are worlds inside the world. Each set owns what a world needs to run
// collectives on its own: a communicator (and its shared-memory group), the
// coordinator of its negotiation, a response cache, a fusion buffer and its slice of
// the request queue. Each cycle (core/loop.cc) serves every set this rank belongs to,
// in increasing id order; set 0 (every rank) is created at init like any other.
//
// Why sets cannot deadlock each other: every rank is in set 0 and runs exactly one
// round of set 0 per cycle, so cycle k is the same on every rank, and in cycle k each
// rank runs round k of each of its sets in id order. The collectives of all sets thus
// follow one global order, (cycle, set id, response order), on every rank that takes
// part in them. Changes to the table (add, remove) are ops of set 0, executed at the
// same point of that order on every rank.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "cycle/autotune.h"
#include "gpu/device.h"
#include "gpu/nccl_comm.h"
#include "backend/backend_mpi.h"
#include "common/config.h"
#include "common/fusion_buffer.h"
#include "cycle/controller.h"
#include "cycle/handle_table.h"
#include "cycle/response_cache.h"
#include "cycle/tensor_queue.h"
#include "cycle/timeline.h"

namespace hvdlite {

struct Counters {
  std::atomic<int64_t> cycles{0}, coordinator_gathers{0}, cache_hits{0}, cache_misses{0},
      collectives{0}, fused_collectives{0}, tensors{0}, bytes{0}, errors{0}, shm_collectives{0},
      wire_bytes{0}, hierarchical_collectives{0}, nccl_collectives{0}, staged_collectives{0},
      nccl_us{0}, caller_cycles{0}, carried_collectives{0};
};

// Bytes one rank sends to the others in a collective whose buffer (allreduce) or result
// (allgather, broadcast, reducescatter's input) is `payload` bytes, counted as a
// bandwidth-optimal algorithm sends them, whichever path ran: what a compressor saves is
// then counted the same way for every op (hvdlite_stats_t.wire_bytes).
int64_t WireBytes(int32_t op, int64_t payload, int size);

// The topology-layer knobs of config, the same for every process set's communicator
// (the world's and each subset's: a subset's hosts are its members' hosts).
LayerSettings LayersOf(const Config& config);

// Who is in a set. Immutable once made; framework threads read it (validation at
// enqueue) while the background thread may be removing the set, hence shared.
struct ProcessSetMembers {
  ProcessSetMembers(int32_t id, std::vector<int> ranks, int global_rank);
  int32_t id;
  std::vector<int> ranks;  // global ranks, increasing
  int rank;                // this process's rank in the set, -1 outside it
  int size() const { return static_cast<int>(ranks.size()); }
  bool included() const { return rank >= 0; }
  // The set rank of a global rank, -1 when it is not a member.
  int SetRank(int global_rank) const;
  // "process set 1 (ranks 0, 2)".
  std::string Describe() const;
  // Where an error happened, appended to messages: "" in the global set (every rank),
  // else " in process set 1 (ranks 0, 2)".
  std::string Where() const;
};

class ProcessSetTable;

// The flags every round ORs over the set's members: what this rank says, and what it
// heard from any of its sets this cycle.
struct RoundFlags {
  bool shutdown = false;  // asks to stop the job
  // Has ops in flight in another set than the round's. A rank that hears it cycles at
  // the cycle time instead of the idle time: every rank takes part in set 0's round
  // each cycle, so an idle rank's pace would hold back the rounds of the sets it is not
  // in. (Ops of the round's own set cannot complete without this rank's requests
  // anyway, so they leave its pace alone, as in a job with the global set only.)
  bool elsewhere = false;
};

// What every set's world shares with the rest of the core; all owned by Core.
struct CoreParts {
  const Config& config;
  TensorQueue& queue;
  HandleTable& handles;
  Counters& counters;
  Timeline& timeline;
  ProcessSetTable& sets;
  Autotuner& autotune;  // the knobs in force; the global set's round carries them
  gpu::Device& gpu;     // the process's GPU, once a device tensor came
  std::function<void(const Status&)> end_loop;  // a transport failure ends the loop
};

// One set's world: its negotiation and execution, run by the background thread for
// the members only (a non-member's table entry has no communicator and never runs).
class ProcessSetState {
 public:
  ProcessSetState(std::shared_ptr<const ProcessSetMembers> members,
                  std::unique_ptr<MpiBackend> mpi, CoreParts parts);
  const std::shared_ptr<const ProcessSetMembers>& members() const { return members_; }
  int32_t id() const { return members_->id; }
  bool included() const { return members_->included(); }
  // Something to coordinate even without requests (a join in progress).
  bool Busy() const { return local_joined_ || join_active_; }

  // The cycle's thread (core/loop.cc). A request of this set popped from the queue this cycle.
  void Accept(TensorEntry* e) { fresh_.push_back(e); }
  // This rank refuses the op q names (q.refusal, see Core::Refuse): it goes to the
  // coordinator this round, and the name's cache slot is marked invalid so that every
  // member negotiates it afresh.
  void Refuse(Request q);
  // join()'s caller gave up (Core::LeaveJoin made q, the request that tells the
  // coordinator): after this cycle's requests are sorted, the pending join fails here
  // and q goes to the coordinator.
  void LeaveJoin(Request q) { leave_join_ = std::move(q); }
  // One round of this set: sort the new requests (cache hit or not), coordinate,
  // negotiate what is not cached, execute, complete. heard collects the flags of the
  // members (ORed into what it holds). Returns false when the loop must end.
  bool RunCycle(Clock::time_point now, const RoundFlags& mine, RoundFlags* heard);
  // The largest blocking op on host memory whose cycle a framework thread may run
  // (MpiBackend::CallerCycleBytes for this set's bit vector), 0 for none.
  int64_t CallerCycleBytes() const;
  // Fails this set's ops in flight with s (the set is being removed).
  void FailInFlight(const Status& s);
  // Frees the communicator; collective over the members when transport_ok.
  void Close(bool transport_ok) {
    nccl_.Destroy();
    mpi_->Shutdown(transport_ok);
  }

 private:
  // Steps of RunCycle.
  void SortFresh(Clock::time_point now);
  // What LeaveJoin asked: fails the pending join and tells the coordinator (or drops the
  // join's request if it was never sent).
  void LeftJoin();
  // The bit-vector round: fills ready with the cached responses every member is ready
  // for; false (loop ends) on a transport failure.
  // The coordination's bit vector: [flags | hit bits | invalid bits | autotune's].
  struct BitsLayout {
    size_t words, tuned;
    size_t size() const { return 1 + 2 * words + tuned; }
  };
  BitsLayout Bits() const;
  bool Coordinate(Clock::time_point now, const RoundFlags& mine, bool* any_uncached,
                  RoundFlags* heard, std::vector<Response>* ready);
  // A carried op: the data of a small cached allreduce, allgather, broadcast, alltoall
  // or reducescatter of host tensors that is this rank's only request rides with the
  // coordination round (the round's companion, MpiBackend::Companion), so that, when every member's came, the op runs
  // from those copies without a meeting of its own. Carry writes this rank's (before the
  // round, whose vector has `words`) and returns the op (tag: its cache slot, or -1
  // where this round carries none). Carried (after the round, ready as the round left
  // it) says whether every member carried that op, and keeps their data for Execute.
  CarriedOp Carry(int64_t words);
  // Whether reduction r (an allreduce or reducescatter) runs in the order a carried copy
  // is reduced in, for a round of `words`: through shared memory on one host, or over
  // the layers in the layered round (each host's ranks in rank order, then the hosts in
  // host order): every allreduce there, and a reducescatter that runs as one
  // (ReducescatterByLayers).
  bool ReducesInDataOrder(const Response& r, int64_t words) const;
  // A reducescatter of at most ShmCollectives::kCompanionBytes across hosts whose
  // allreduce goes over the layers in the layered round's order (CarriesInDataOrder)
  // runs as that allreduce of its whole input, each rank keeping its rows: MPI's reduce-scatter reduces in an order of its own, which a
  // carried copy could not match, so without this none was carried there (on 2 hosts of
  // 2 ranks a 4 KiB float reducescatter took 5-7x mpi4py's time).
  bool ReducescatterByLayers(const Response& r) const;
  bool Carried(const CarriedOp& carried, int64_t words, const std::vector<Response>& ready);
  bool Negotiate(Clock::time_point now, std::vector<Response>* ready);
  void Execute(const std::vector<Response>& ready);
  // Steps of Execute: which ready responses run as one collective (the end of each
  // run), and their operation spans opened on the timeline.
  std::vector<size_t> PlanFusion(const std::vector<Response>& ready) const;
  void BeginOpsOnTimeline(const std::vector<Response>& ready, const std::vector<size_t>& ends);

  void ExecuteAllreduce(const std::vector<const Response*>& fused);
  // The knobs in force this cycle that the backend's choice of allreduce reads.
  AllreduceTuning Tuning() const;
  void ExecuteFusedAllgather(const std::vector<const Response*>& fused);
  static int64_t AllgatherBytes(const Response& r);
  // One response that is not fused: the op's own function below, then its completion.
  void ExecuteOne(const Response& r);
  // What one op moved, for the counters: bytes of its payload and (alltoall) the bytes
  // sent to other ranks, -1 when counted from moved (WireBytes).
  struct OpTally {
    int64_t moved = 0;
    int64_t sent_away = -1;
    const char* activity = nullptr;  // the collective's timeline activity, if not the op's MPI one
  };
  Status RunOp(const Response& r, TensorEntry* e, OpOutput* out, OpTally* tally);
  Status ExecuteAllgather(const Response& r, TensorEntry* e, OpOutput* out, OpTally* tally);
  Status ExecuteBroadcast(const Response& r, TensorEntry* e, OpTally* tally);
  // The carried op's data path: its result from every member's carried data.
  Status ReduceCarried(const Response& r, TensorEntry* e, const AllreduceOptions& options);
  void CountCarried();
  Status ExecuteAlltoall(const Response& r, TensorEntry* e, OpOutput* out, OpTally* tally);
  Status ExecuteReducescatter(const Response& r, TensorEntry* e, OpTally* tally);
  // GPU tensors (gpu_execution.cc): ready[begin, end) through NCCL, or staged through
  // pinned host memory into the functions above (Finish then copies results back).
  void ExecuteOnDevice(const std::vector<Response>& ready, size_t begin, size_t end);
  // How this set runs GPU tensors, decided once by all members together.
  enum class GpuPath { kUndecided, kNccl, kStaged, kFailed };
  Status DecideGpuPath(int device);
  bool NcclCanRun(const Response& r) const;
  Status RunOnNccl(const std::vector<const Response*>& run, const std::vector<TensorEntry*>& entries);
  // Points each entry at pinned host memory; copies the inputs down unless the caller
  // does (the allreduce's pipeline, piece by piece).
  Status StageIn(const std::vector<const Response*>& run, const std::vector<TensorEntry*>& entries,
                 bool copy_inputs);
  // A staged allreduce's data path: the pieces (host memory, as StageIn left them)
  // reduced in chunks, each copied down, reduced and copied up while the next moves.
  Status AllreduceStaged(const std::vector<TensorEntry*>& entries, const std::vector<ShmCollectives::Piece>& pieces,
                         const AllreduceOptions& options, const AllreduceTuning& tuning,
                         const std::function<void(const char*)>& step);
  // Copies staged results back to the device; returns s, or the copy's failure.
  Status StageOut(const std::vector<TensorEntry*>& entries, const Status& s);
  // The table changes, run where the response list puts them on every rank.
  Status AddSet(const Response& r, OpOutput* out);
  Status RemoveSet(const Response& r);
  void Finish(TensorEntry* e, const Status& s, OpOutput out = OpOutput());
  // Finish for ops without outputs of their own (a fused allreduce), in one go.
  void FinishAll(const std::vector<TensorEntry*>& entries, const Status& s);
  // A transport failure ends the loop after this round, with s as the reason; returns
  // false (RunCycle's "stop").
  bool EndLoop(const Status& s);

  const std::shared_ptr<const ProcessSetMembers> members_;
  const int rank_, size_;  // in the set
  const Config& config_;
  TensorQueue& queue_;
  HandleTable& handles_;
  Counters& counters_;
  Timeline& timeline_;
  ProcessSetTable& sets_;
  Autotuner& autotune_;
  gpu::Device& gpu_;
  std::function<void(const Status&)> end_loop_;

  std::unique_ptr<MpiBackend> mpi_;
  std::unique_ptr<ResponseCache> cache_;
  std::unique_ptr<Controller> controller_;  // on the set's rank 0 only
  FusionBuffer fusion_;
  std::vector<TensorEntry*> fresh_;  // this cycle's new entries of this set
  std::vector<Request> uncached_;
  // This rank's requests that were cache hits, waiting for every member's bit: slot ->
  // when it was enqueued. (A Put that gives such a slot to another name first sends the
  // request to the coordinator: Negotiate.)
  std::map<int64_t, Clock::time_point> cached_pending_;
  // A pending hit's request (the name its slot holds) back to uncached_ for the
  // coordinator, out of cached_pending_.
  void PendingToCoordinator(std::map<int64_t, Clock::time_point>::iterator pending);
  std::set<int64_t> invalid_slots_;
  bool join_active_ = false;
  bool local_joined_ = false;
  std::optional<Request> leave_join_;
  bool failed_ = false;  // a transport failure: the loop ends after this round
  // The op this round carried (Carried): its name ("" when none) and the data that
  // came with the round (MpiBackend::CarriedParts; in shared memory or the round's
  // records until the next round).
  std::string carried_;
  std::vector<const uint8_t*> carried_parts_;
  std::vector<int64_t> carried_lengths_;     // an allgather's or alltoall's parts' bytes
  std::vector<const uint8_t*> carried_ranks_;  // and where each rank's data starts in them
  int64_t queue_start_us_ = 0;  // timeline: when this cycle's operations began to queue

  GpuPath gpu_path_ = GpuPath::kUndecided;
  std::string gpu_path_error_;  // kFailed: why, for every later GPU op of the set
  gpu::NcclComm nccl_;
  // A staged collective in flight: each staged entry's device input and output, and
  // where its result lies in host memory (Finish copies it back before the handle
  // completes, unless the allreduce's pipeline did: output_bytes 0 then).
  struct Staged {
    TensorEntry* entry;
    const void* device_input;
    void* device_output;
    int64_t output_bytes;
  };
  std::vector<Staged> staged_;
};

// Id -> set. The background thread changes it (under the mutex) and reads it freely;
// framework threads read the members under the mutex.
class ProcessSetTable {
 public:
  // Any thread. Null when there is no set of that id.
  std::shared_ptr<const ProcessSetMembers> Members(int32_t id) const;
  std::vector<std::shared_ptr<const ProcessSetMembers>> All() const;
  // The id of the set of exactly these (increasing) ranks, or -1.
  int32_t IdOf(const std::vector<int>& ranks) const;

  // The cycle's thread (core/loop.cc).
  ProcessSetState* Find(int32_t id) const;
  // The set after `id` (-1: the first) that this rank belongs to, in id order; null
  // after the last.
  ProcessSetState* NextMember(int32_t id) const;
  // The lowest id no set has.
  int32_t FreeId() const;
  void Insert(std::unique_ptr<ProcessSetState> set);
  std::unique_ptr<ProcessSetState> Take(int32_t id);
  // Closes and drops every set, the highest id first (set 0, which may finalize MPI,
  // last).
  void Clear(bool transport_ok);

 private:
  mutable std::mutex mutex_;
  std::map<int32_t, std::unique_ptr<ProcessSetState>> sets_;  // Written under mutex_.
};

}  // namespace hvdlite
