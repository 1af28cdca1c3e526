// Every MPI call of the core, over one communicator: the world's (Init) or a process
// set's (InitSubset). The thread that runs the cycle (core/loop.cc): the background
// thread, or a framework thread that runs its blocking call's cycle where
// CallerCycleBytes lets it.
//
// Negotiation uses nonblocking collectives polled with a growing sleep (PollBackoff),
// because a peer may still be computing and a rank blocked in MPICH busy-polls a core.
// Data collectives run after every rank agreed to run them now: on one host they use
// the blocking calls, which progress fastest (MPI's shared memory is done in moments);
// across hosts, where one waits on the network for as long as the link takes, the
// nonblocking ones, polled with short sleeps.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/allreduce_options.h"
#include "common/common.h"
#include "common/fusion_buffer.h"
#include "common/thread_sched.h"
#include "algorithms/hierarchical_allgather.h"
#include "algorithms/hierarchical_allreduce.h"
#include "algorithms/hierarchical_broadcast.h"
#include "algorithms/leader_allreduce.h"
#include "common/poll_backoff.h"
#include "transport/shm_collectives.h"
#include "transport/topology_layers.h"

namespace hvdlite {

// The knobs autotune may change between cycles that choose and shape an allreduce
// (TunedKnobs' part that the backend reads).
struct AllreduceTuning {
  bool hierarchical = true;     // the layered allreduce, where it was built
  int64_t shm_chunk_bytes = 0;  // ShmCollectives::set_chunk_bytes
};

// A small op whose data rides with a coordination round (ProcessSetState::Carry): its
// cache slot as the round's tag (-1: none), its bytes, and what a host's step of the
// layered round needs to combine its ranks' data. Every rank of an allreduce (its data
// prescaled) or an allgather and a broadcast's root write their data into Companion()
// first.
struct CarriedOp {
  int64_t tag = -1;
  int64_t nbytes = 0;  // an allgather: this rank's part
  int64_t count = 0;
  int32_t dtype = 0, reduce_op = 0;
  int root = -1;        // a broadcast's root; -1: an allreduce or allgather
  bool gather = false;  // an allgather
};

// The algorithms an allreduce may run by: over the topology layers (hierarchical or
// leader), through shared memory on one host, or over MPI.
enum class AllreduceAlgorithm { kLayers, kSharedMemory, kMpi };

struct MpiTopology {
  int rank = 0, size = 1, local_rank = 0, local_size = 1, cross_rank = 0, cross_size = 1;
  bool threads_multiple = false;
  CoreSharing sharing;  // the ranks that share this one's cores (of the world's ranks)
};

class MpiBackend {
 public:
  // comm_f2c < 0: MPI_COMM_WORLD. Initializes MPI when nobody has, from the calling
  // (background) thread, at MPI_THREAD_MULTIPLE if thread_multiple, else FUNNELED.
  // Builds the topology layers (topology_layers.h) as `layers` and PlanLayers say: on
  // one host, allreduce (and AND the coordination's bits) through shared memory
  // (ShmCollectives) instead of MPI; on several, the hierarchical allreduce.
  Status Init(int64_t comm_f2c, bool thread_multiple, const LayerSettings& layers,
              MpiTopology* topo);
  // The communicator of a process set: its members among parent's ranks, in parent's
  // rank order, with layers of its own built from the same settings (its hosts are
  // its members' hosts, split the same way). Collective over every rank of parent; a
  // rank that is not a member passes member = false and gets no communicator (this
  // backend stays unused).
  Status InitSubset(const MpiBackend& parent, bool member, const LayerSettings& layers);
  // Frees the core's communicators; finalizes MPI if Init initialized it and
  // `finalize` is set (not after a transport failure, where it could hang).
  void Shutdown(bool finalize);

  // Negotiation. On one host (where the allreduce goes through shared memory) all three
  // go through shared memory (AndBits where the vector fits there), so that a cycle
  // there makes no MPI call (CallerCycleBytes); otherwise through nonblocking MPI
  // polled with a backoff.
  //
  // A small set whose ranks are each alone on their host ANDs by one direct exchange
  // of every rank's vector (ExchangeRecords) instead; hosts of several ranks each, as
  // many ranks on each and at most kDirectRanks of them, AND on each host through shared
  // memory, then by that exchange among the ranks of one local rank (the layered round).
  //
  // A small op's data may ride with the bit vector (a companion), through shared memory
  // (ShmCollectives::AndBits), in the direct exchange's records or in both steps of the
  // layered round: Companion(bytes, words) is where this rank writes it for its next
  // AndBits (of a vector of `words`), null where that round cannot carry it (an
  // MPI_Iallreduce, or too large); AndBits then takes the op (CarriedOp), and
  // CarriedParts gives the data that came with the round.
  Status AndBits(std::vector<uint64_t>* bits, const CarriedOp& carried = CarriedOp());
  uint8_t* Companion(int64_t bytes, int64_t words);
  // After AndBits: whether every rank carried `carried` (the same answer on every rank:
  // each reads the same records); then *parts holds, for an allreduce, every rank's
  // data in rank order (each prescaled; the layered round: each host's, reduced over its
  // ranks in rank order, in host order), for a broadcast the root's alone; for an
  // allgather every rank's in rank order (the layered round: each host's ranks'
  // concatenated, in host order, where hosts hold consecutive ranks) with their lengths
  // in *lengths, for the caller to check.
  bool CarriedParts(const CarriedOp& carried, std::vector<const uint8_t*>* parts,
                    std::vector<int64_t>* lengths) const;
  // Whether an allreduce carried by the next round of `words` is reduced in the order
  // its data path would reduce it (through shared memory, or over the hosts' layers),
  // so that every result has the same bits carried or not.
  bool CarriesInDataOrder(int64_t words, const AllreduceTuning& tuning) const;
  // Rank 0 receives every rank's blob; others get an empty vector.
  Status GatherBlobs(const std::vector<uint8_t>& mine, std::vector<std::vector<uint8_t>>* all);
  Status BroadcastBlob(std::vector<uint8_t>* blob);  // from rank 0

  // Data (blocking). Each collective's algorithm is chosen here, from the layers this
  // communicator has (and for allreduce the knobs in force): the executor fuses and
  // calls. Allgather and broadcast go through the hosts' leaders when the layers say
  // so, waiting without spinning.
  //
  // The allreduce of a run of fused tensors, as options say, by ChooseAllreduce's
  // algorithm: over the layers and through shared memory the pieces are read and
  // written in place; over MPI one tensor is reduced in its output, several packed
  // into fusion. step_done names each step for the timeline as it ends.
  Status Allreduce(const std::vector<ShmCollectives::Piece>& pieces, const AllreduceOptions& options,
                   const AllreduceTuning& tuning, FusionBuffer* fusion,
                   const LayeredAllreduce::StepDone& step_done);
  AllreduceAlgorithm ChooseAllreduce(const AllreduceTuning& tuning) const {
    if (tuning.hierarchical && layered_allreduce_) return AllreduceAlgorithm::kLayers;
    return shared_memory() ? AllreduceAlgorithm::kSharedMemory : AllreduceAlgorithm::kMpi;
  }
  // Allgatherv, ReduceScatter, Bcast and Alltoallv go through shared memory where the
  // allreduce does (ShmGathers), else over MPI (Allgatherv and Bcast across hosts through the
  // leaders, when the layers say so).
  Status Allgatherv(const void* in, int64_t in_bytes, void* out,
                    const std::vector<int64_t>& bytes_per_rank);
  // Allgatherv through shared memory (only where ShmGathers()), the result (every rank's
  // bytes in rank order) written into the outs pieces, in order: no unpacking after.
  Status ShmAllgatherv(const void* in, const std::vector<ShmCollectives::Piece>& outs,
                       const std::vector<int64_t>& bytes_per_rank);
  // Root's in into every rank's buf (the root's too, where in is not buf: on one host
  // filled beside the others' copies, elsewhere copied first; the others' in is unused).
  Status Bcast(const void* in, void* buf, int64_t nbytes, int root);
  // matrix: every rank's send_bytes, row by row (what rank j sends rank k at j * size +
  // k): with it, and where ShmGathers(), the alltoall goes through shared memory.
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                   const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>* matrix = nullptr);
  Status ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts,
                       int32_t dtype, int32_t reduce_op);

  // Whether the allreduce goes through shared memory (every rank of this communicator
  // on one host).
  bool shared_memory() const { return host_ != nullptr && !layered_allreduce_; }
  // Whether the coordination round goes through one host's shared memory alone.
  bool ShmRound(int64_t words) const {
    return !alone_ && shared_memory() && words <= ShmCollectives::kMaxBitsWords;
  }
  // A framework thread of this process waits for a blocking op's result: the
  // shared-memory waits of small collectives may poll before they sleep
  // (ShmCollectives::set_waits_may_poll), and the MPI waits across hosts for the
  // coordination and small collectives spin for PollBackoff::kCallerSpin before their
  // first sleep (WaitBackoff).
  void set_caller_waiting(bool waiting);
  // Whether allgathers, reducescatters and broadcasts go through shared memory: where the
  // allreduce does, at every size. (No threshold: from 4 KiB to 64 MiB per rank, at 2 and
  // 3 ranks, they were faster than MPICH's MPI_Allgatherv and MPI_Reduce_scatter, e.g. at
  // 3 ranks 384 against 612 us at 4 KiB, 2.7 against 6.6 ms at 1 MiB: benchmarks/latency.py.)
  bool ShmGathers() const { return shared_memory(); }
  // The largest input (bytes) of a blocking call on host memory whose cycle (of a bit
  // vector of `words`) the calling framework thread may run itself (Core::
  // RunCallerCycle), saving the two task switches of the hand-off; 0 where it may not:
  // - a rank alone (a world or a set of one) where MPI takes calls from any thread: up
  //   to kCallerCycleMaxBytes; nothing waits for a peer, and its copies through MPI
  //   are local (one process, a 4 KiB allreduce 16.6 -> 5.6 us, a broadcast 18.1 -> 5.9);
  // - every rank of this communicator on one host, 2 or more of them, shared memory on
  //   (a rank alone copies through MPI), bits up to ShmCollectives::kMaxBitsWords: the
  //   round, the negotiation and the collectives of host tensors make no MPI call; up to
  //   kCallerCycleMaxBytes where each rank has a core (cores_for_each_), whose caller
  //   polls through the collective's steps as the background thread would only after
  //   two hand-offs and a sleep per step (ShmCollectives::kPollMaxBytes); up to
  //   kCallerCycleCrowdedMaxBytes where they outnumber the cores;
  // - across hosts, where the round is the direct or layered exchange of records and MPI
  //   takes calls from any thread (MPI_THREAD_MULTIPLE): up to what the round carries
  //   (ShmCollectives::kCompanionBytes), so that the op usually runs from the round's
  //   copies. A larger op's MPI collective would wait at the caller's normal priority
  //   rather than the background thread's real-time one (64 KiB on 2 hosts of one rank:
  //   1.3-1.5x mpi4py handed off, 1.5-2.5x in the caller). Not where the ranks sharing
  //   this one's cores outnumber them (cores_for_each_): there a peer's answer waits for
  //   a core whichever thread asks, and the caller's cycle gained nothing (4 ranks on 2
  //   cores: 4 KiB allreduce 2.2-2.4x mpi4py against 2.0, a float reducescatter 6.6-6.8x
  //   against 4.8-5.7). The caller's MPI calls are guarded like the background thread's,
  //   and it leaves a cycle that faults or whose peers are lost (CycleEscape,
  //   transport/mpi_fault_guard.h).
  int64_t CallerCycleBytes(int64_t words) const;
  // Up to 1 MiB a caller that polls its own cycle saves a third to a half of the call (2
  // ranks, one host, a barrier before each call, 256 KiB: allreduce 91 -> 51 us,
  // broadcast 100 -> 55, alltoall 174 -> 79; 1 MiB: allreduce 246 -> 135, broadcast
  // 232 -> 134); beyond, the copies are the call's time and the background thread's
  // pipeline serves as well. Where ranks outnumber the cores, a larger collective's
  // chunks wait on the peers many times, and the background thread's waits wake at
  // real-time priority (a caller's, at normal priority, may wait for its core behind
  // another thread).
  static constexpr int64_t kCallerCycleMaxBytes = 1024 * 1024;
  static constexpr int64_t kCallerCycleCrowdedMaxBytes = 64 * 1024;
  // Whether an allreduce over the layers (hierarchical or leader) was built.
  bool layered_allreduce() const { return layered_allreduce_ != nullptr; }
  // Whether allgather (Allgatherv) and broadcast (Bcast) go through the hosts' leaders.
  bool hierarchical_allgather() const { return hierarchical_allgather_ != nullptr; }
  bool hierarchical_broadcast() const { return hierarchical_broadcast_ != nullptr; }

  static std::string LibraryVersion();

 private:
  // GatherBlobs through shared memory: the lengths, then the blobs.
  Status ShmGatherBlobs(const std::vector<uint8_t>& mine, std::vector<std::vector<uint8_t>>* all);
  // Allreduce over MPI (kMpi): packs several pieces into fusion.
  Status FlatAllreduce(const std::vector<ShmCollectives::Piece>& pieces, const AllreduceOptions& options,
                       FusionBuffer* fusion, const LayeredAllreduce::StepDone& step_done);
  // One MPI allreduce of count elements; in == out reduces in place.
  Status MpiAllreduce(const void* in, void* out, int64_t count, int32_t dtype, int32_t reduce_op);
  // bytes: a data collective's size (0 for the coordination's waits); up to
  // kCallerSpinMaxBytes, the wait spins for PollBackoff::kCallerSpin before it sleeps
  // while a caller blocks on the result (set_caller_waiting).
  // count: requests (an array of MPI_Request) that must all complete.
  Status WaitBackoff(void* request, const char* what,
                     std::chrono::microseconds max_sleep = PollBackoff::kWaitMaxSleep, int64_t bytes = 0,
                     int count = 1);
  static constexpr int64_t kCallerSpinMaxBytes = 16 * 1024;
  // Runs a data collective: call(nullptr) makes the blocking MPI call, call(request)
  // (an MPI_Request*) posts the nonblocking one; returns an MPI error code. Blocking on
  // one host; across hosts posted and waited on with WaitBackoff.
  Status Collective(const char* what, int64_t bytes, const std::function<int(void*)>& call);
  // After comm_ is set: errors as codes, the 16-bit reductions, the topology of comm_
  // and its layers (SetUpLayers). Collective over comm_.
  Status Attach(const LayerSettings& layers, MpiTopology* topo);
  // Collective over comm_: the layers PlanLayers chooses, built from the host
  // communicator `local` and the cross-host one `cross` (both MPI_Comm*, taken over).
  Status SetUpLayers(const LayerSettings& settings, const MpiTopology& topo, void* local, void* cross);

  void* comm_ = nullptr;  // MPI_Comm*, kept opaque so that only common/mpi_glue.h includes mpi.h
  int global_rank_ = 0;   // this rank in the job (the world's communicator)
  bool spans_hosts_ = false;  // this communicator's ranks are on more than one host
  bool alone_ = false;        // it has one rank: a blocking call never waits for a peer
  // How the last AndBits went: companions came with the shared memory's, the direct
  // exchange's and the layered rounds.
  enum class Round { kMpi, kShm, kDirect, kLayered };
  Round round_ = Round::kMpi;
  Round RoundFor(int64_t words) const {
    if (ShmRound(words)) return Round::kShm;
    if (direct_round_) return Round::kDirect;
    if (layered_round_ && words <= ShmCollectives::kMaxBitsWords) return Round::kLayered;
    return Round::kMpi;
  }
  // Record k of the last round's exchange (its tag and companion), or of the host's
  // shared memory (kShm): k a rank of the exchange (kLayered: of the cross layer).
  int64_t RoundRecord(int k, const uint8_t** data, int64_t* bytes) const;
  int RoundRanks() const;
  // The coordination of a set of at most kDirectRanks ranks, each alone on its host, as
  // one exchange of every rank's record with every other (decided alike on every rank in
  // SetUpLayers): across hosts, where an MPI_Iallreduce of a few words takes a network
  // trip as well (recursive doubling: log2(size) of them), and the records have room for
  // a companion. A record: a 64-byte head (tag, companion bytes), the companion, then
  // the bit vector at the next multiple of 8.
  static constexpr int kDirectRanks = 8;
  static constexpr int kRecordHead = 64;
  // No other point-to-point message uses comm_; on the cross layer's communicator
  // CrossLayer's use the tags of its slots (0, 1).
  static constexpr int kRoundTag = 7301;
  int rank_ = 0, size_ = 1;               // in comm_
  bool direct_round_ = false;
  bool layered_round_ = false;  // hosts of one size, at most kDirectRanks of them
  bool threads_multiple_ = false;  // MPI provides MPI_THREAD_MULTIPLE
  // What the negotiation's first nonblocking calls send or receive: members, not a
  // frame's locals, as a caller's cycle left by its escape (mpi_fault_guard.h) abandons
  // its frames with those calls pending (heap buffers are left allocated).
  int gather_len_ = 0;
  int64_t broadcast_len_ = 0;
  bool consecutive_hosts_ = false;  // host k holds ranks k * local_size, k * local_size + 1, ...
  std::vector<uint8_t> record_;                // this rank's
  std::vector<std::vector<uint8_t>> records_;  // the peers' (each sized for the largest)
  int record_rank_ = 0;                        // this rank's place among them
  // One exchange of records among the `size` ranks of `comm` (this one `rank`).
  Status ExchangeRecords(void* comm, int rank, int size, std::vector<uint64_t>* bits, int64_t tag,
                         int64_t bytes);
  // The layered round's host step, after the host's AND: the host's companions
  // combined into this rank's record (a broadcast's root's data, an allreduce's sum
  // over the host's ranks in rank order) where every rank of the host carried the op;
  // returns the record's tag (-1: not carried) and sets *bytes.
  int64_t CombineHost(const CarriedOp& carried, int64_t* bytes);
  // A caller waits and this host has a core for each of its ranks (set_caller_waiting,
  // each cycle): WaitBackoff's polls, and the shared-memory waits, poll longer before
  // they sleep. The cycle's thread.
  bool caller_waiting_ = false;
  bool cores_for_each_ = false;  // at least one core per rank sharing them (sharing_)
  CoreSharing sharing_;
  std::vector<void*> ops_;  // user-defined reductions for 16-bit floats
  // The layers in use: host_ alone (every rank on one host, shared memory), all three
  // (hierarchical allreduce), or none (flat MPI).
  std::unique_ptr<HostLayer> host_;
  std::unique_ptr<CrossLayer> cross_;
  bool cross_every_rank_ = false;  // hosts of one size: every rank in a cross layer
  std::unique_ptr<LayeredAllreduce> layered_allreduce_;
  // Allgather and broadcast across hosts: the host's ranks and the hosts' leaders
  // (leaders_ on local rank 0 only) over MPI, and the plans of steps over them.
  std::unique_ptr<GroupLayer> host_group_, leaders_;
  std::unique_ptr<HierarchicalAllgather> hierarchical_allgather_;
  std::unique_ptr<HierarchicalBroadcast> hierarchical_broadcast_;
};

}  // namespace hvdlite
