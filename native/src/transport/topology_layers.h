// Topology in layers: the ranks of one host, which share memory, and the network
// between hosts, where the ranks of one local rank (one per host) form a layer of
// their own. Each layer is an object with its own communicator and buffers, built from
// communicators handed to it, so that a process set can own a set of them.
//
// topology_layers.cc and backend/backend_mpi.cc are the only files that call MPI (through
// common/mpi_glue.h); communicators travel as void* (MPI_Comm*) everywhere else.
// Background thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/common.h"
#include "transport/shm_collectives.h"

namespace hvdlite {

// What decides the layers, from the HVDLITE_* knobs (config.h).
struct LayerSettings {
  // HVDLITE_HOST_ID: ranks with equal ids count as one host (for tests: "hosts" on one
  // machine; or a cluster where MPI's own idea of a node is wrong). Empty: MPI's split
  // by shared memory (MPI_COMM_TYPE_SHARED).
  std::string host_id;
  // HVDLITE_HIERARCHICAL_ALLREDUCE (HOROVOD_HIERARCHICAL_ALLREDUCE): -1 when unset (on
  // with more than one host and more than one rank on each), 0 off, 1 on.
  int hierarchical_allreduce = -1;
  // HVDLITE_SHM_ALLREDUCE: whether the ranks of a host may reduce through shared memory
  // (the host layer of the hierarchy, or every rank when all share one host).
  bool shared_memory = true;
  // HVDLITE_HIERARCHICAL_ALLGATHER (HOROVOD_HIERARCHICAL_ALLGATHER) and
  // HVDLITE_HIERARCHICAL_BROADCAST: -1 when unset (on with more than one host and more
  // than one rank on some host), 0 off, 1 on.
  int hierarchical_allgather = -1;
  int hierarchical_broadcast = -1;
};

// Splits world (collectively) into the ranks of this rank's host, in world rank order:
// by host_id when given, else by MPI_COMM_TYPE_SHARED. *local receives an MPI_Comm.
Status SplitHosts(void* world, const std::string& host_id, void* local);

// Where one rank sits, as every rank learns it at init.
struct RankPlace {
  int local_rank = 0, local_size = 1;
  int hierarchical_allreduce = -1;  // its LayerSettings values
  int shared_memory = 1;
  int host = 0;  // the lowest rank on its host, which names the host
  int hierarchical_allgather = -1, hierarchical_broadcast = -1;
};

// The layers every rank uses, decided alike everywhere from every rank's place.
struct LayerPlan {
  bool world_shared_memory = false;  // one host: every rank reduces through shared memory
  bool hierarchical_allreduce = false;  // hosts of one size: shards across hosts
  bool leader_allreduce = false;        // hosts of different sizes: through the leaders
  // Allgather and broadcast through the hosts' leaders (any placement of ranks).
  bool hierarchical_allgather = false, hierarchical_broadcast = false;
  // The ranks of each host in rank order, hosts in the order of their lowest rank.
  std::vector<std::vector<int>> hosts;
  std::string error;   // settings that disagree across ranks
  std::string notice;  // why a requested hierarchy is not used (rank 0 logs it)
};
LayerPlan PlanLayers(const std::vector<RankPlace>& ranks);

// The ranks of one host: their communicator and the shared-memory group through which
// they reduce (ShmCollectives over one segment per rank).
class HostLayer {
 public:
  // Collective over comm (an MPI_Comm*, which the layer keeps and frees); global_rank:
  // this rank's in the job. Null (with a warning) when some rank of the host got no
  // shared segment.
  static std::unique_ptr<HostLayer> Open(void* comm, int global_rank);
  ~HostLayer();
  // Frees the window and communicator; collective when `collective` (a shutdown every
  // rank takes part in), else only forgets them.
  void Close(bool collective);
  ShmCollectives& shm() { return *shm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  HostLayer() = default;
  void* comm_ = nullptr;    // MPI_Comm*
  void* window_ = nullptr;  // MPI_Win*
  int rank_ = 0, size_ = 1;
  std::unique_ptr<ShmCollectives> shm_;
};

// A layer's communicator, taken over at construction (an MPI_Comm*) and freed in
// CloseComm: collectively on a shutdown every rank takes part in, else only forgotten.
class CommLayer {
 public:
  int rank() const { return rank_; }
  int size() const { return size_; }
  void* comm() const { return comm_; }  // MPI_Comm*

 protected:
  explicit CommLayer(void* comm);
  ~CommLayer() { CloseComm(false); }
  void CloseComm(bool collective);
  void* comm_ = nullptr;  // MPI_Comm*
  int rank_ = 0, size_ = 1;
};

// The ranks of one local rank, one per host: the network layer. Its allreduce is a ring
// (reduce-scatter, then allgather, over h - 1 steps each), so each rank sends and
// receives 2 (h - 1) / h of the buffer, what a bandwidth-optimal allreduce must, and the
// result is bit-identical on every rank. It waits on nonblocking MPI with short sleeps:
// a rank waiting on the network does not spin a core (MPICH's blocking waits do).
//
// Two allreduces may be in flight at once (slots 0 and 1, with tags of their own), so
// that the next block's ring starts while the last one's finishes: the link then has
// data queued between one ring's steps, where a ring alone leaves it idle while a step's
// last bytes arrive, are reduced and the next step is posted.
//
// An allreduce of at most kDirectMaxBytes goes in one step instead: every rank sends
// its whole buffer to every other and reduces all of them, in rank order (the same
// order everywhere: the same bits on every rank). Small buffers wait on the network's
// latency, not its rate, and the ring's 2 (size - 1) steps are as many trips.
class CrossLayer : public CommLayer {
 public:
  static constexpr int kSlots = 2;
  static constexpr int64_t kDirectMaxBytes = 16 * 1024;
  explicit CrossLayer(void* comm) : CommLayer(comm) {}
  ~CrossLayer() { Close(false); }
  void Close(bool collective);
  // A framework thread waits for a blocking op's result (MpiBackend::set_caller_waiting):
  // Wait then polls a one-step allreduce for PollBackoff::kCallerSpin before it sleeps.
  void set_caller_waiting(bool waiting) { caller_waiting_ = waiting; }
  // buf = reduce over the layer's ranks of buf (Average: Sum), in place.
  Status Allreduce(void* buf, int64_t count, int32_t dtype, int32_t reduce_op);
  // The same in parts, for overlapping it with other work: Start posts the first step
  // of an allreduce in `slot` (a free one); Progress tests the steps in flight and, for
  // each that is done, reduces what it brought and posts the next; Wait progresses
  // until the slot's allreduce is done. buf must stay until then. Every rank starts
  // its allreduces in the same slots in the same order.
  Status Start(int slot, void* buf, int64_t count, int32_t dtype, int32_t reduce_op);
  Status Progress();
  Status Wait(int slot);
  bool done(int slot) const { return rings_[slot].step >= rings_[slot].steps; }

 private:
  // One allreduce in flight: steps 0 .. size - 2 reduce-scatter, the rest allgather;
  // or, direct, one step.
  struct Ring {
    uint8_t* buf = nullptr;
    int64_t count = 0;
    int32_t dtype = 0, reduce_op = 0;
    int step = 0, steps = 0;
    bool direct = false;
    // A received segment, before it is reduced in; direct: every rank's buffer, in
    // rank order.
    std::vector<uint8_t> scratch;
    std::vector<void*> requests;   // MPI_Request*, of the step in flight
  };
  // Posts the ring's step: sends a segment to the next rank while receiving one from
  // the previous, in messages MPI's int counts can carry, tagged with the slot.
  Status Post(int slot);
  // Posts a direct allreduce's one step: buf to every other rank, theirs into scratch.
  Status PostDirect(int slot);
  Status ProgressRing(int slot);
  uint8_t* Segment(const Ring& ring, int k) const;
  int64_t SegmentBytes(const Ring& ring, int k) const;

  Ring rings_[kSlots];
  bool caller_waiting_ = false;
};

// The requests of nonblocking collectives in flight (MPI_Request*).
class Pending {
 public:
  Pending() = default;
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  ~Pending() { Clear(); }
  // Whether every request is done (tests them all; finished ones are freed).
  Status Test(bool* done);
  bool empty() const { return requests_.empty(); }
  void Add(void* request) { requests_.push_back(request); }
  void Clear();

 private:
  std::vector<void*> requests_;
};

// A group of ranks on one communicator whose collectives run nonblocking, so that
// waiting for them can sleep (RunPipeline): the ranks of one host over MPI, and the
// hosts' leaders (local rank 0 of every host, in host order). Counts are bytes.
class GroupLayer : public CommLayer {
 public:
  explicit GroupLayer(void* comm) : CommLayer(comm) {}
  void Close(bool collective) { CloseComm(collective); }
  // Each call posts its collective and adds its requests to *pending. Rank 0 receives
  // rank k's in_bytes at out + displs[k]; buf's parts [displs[k], + bytes[k]) go to
  // every rank from rank k (rank k's in place); buf's bytes go from root to all.
  Status Gatherv(const void* in, int64_t in_bytes, void* out, const std::vector<int64_t>& bytes,
                 const std::vector<int64_t>& displs, Pending* pending);
  Status Allgatherv(void* buf, const std::vector<int64_t>& bytes,
                    const std::vector<int64_t>& displs, Pending* pending);
  Status Bcast(void* buf, int64_t bytes, int root, Pending* pending);
};

// A collective in chunks and stages: stage s of chunk k posts its collectives (or none,
// on a rank with no part in it) into the Pending it is given. It starts once stage
// s - 1 of chunk k is done and stage s of chunk k - 1 has started, so every rank posts
// the collectives of one communicator in the same order, and the stages of
// neighbouring chunks overlap (chunk k crosses the network while chunk k - 1 is shared
// within the host). Waits with short sleeps, not spinning a core.
using PipelineStage = std::function<Status(int64_t chunk, Pending* pending)>;
Status RunPipeline(int64_t chunks, const std::vector<PipelineStage>& stages);
// How many chunks a pipelined collective of `bytes` goes through: chunks of 1 MiB,
// large enough for the network to run at full rate, and at least 8 of 256 KiB or more
// for a smaller buffer, so that it too overlaps its stages.
int64_t PipelineChunks(int64_t bytes);

}  // namespace hvdlite
