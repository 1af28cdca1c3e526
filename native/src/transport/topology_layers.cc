#include "transport/topology_layers.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>

#include "common/mpi_glue.h"
#include "common/poll_backoff.h"
#include "transport/mpi_fault_guard.h"

namespace hvdlite {
namespace {

// Longest HVDLITE_HOST_ID, so that every rank sends the same number of bytes.
constexpr size_t kMaxHostId = 255;
// Bytes per message of the cross-host ring (MPI counts are int).
constexpr int64_t kMaxMessage = 1 << 30;

}  // namespace

Status SplitHosts(void* world, const std::string& host_id, void* local) {
  MPI_Comm w = Comm(world);
  int rank = 0, size = 1;
  MPI_Comm_rank(w, &rank);
  MPI_Comm_size(w, &size);
  // Whether any rank names its host: then all must, or the split would mix two ideas
  // of a host.
  int named = host_id.empty() ? 0 : 1, named_all = 0, named_any = 0;
  MPI_Allreduce(&named, &named_all, 1, MPI_INT, MPI_MIN, w);
  MPI_Allreduce(&named, &named_any, 1, MPI_INT, MPI_MAX, w);
  if (named_any && !named_all) {
    return InvalidArgument("HVDLITE_HOST_ID is set on some ranks only; set it on every rank or none");
  }
  if (!named_any) {
    return Check(MPI_Comm_split_type(w, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &Comm(local)),
                 "MPI_Comm_split_type");
  }
  if (host_id.size() > kMaxHostId) {
    return InvalidArgument("HVDLITE_HOST_ID is longer than " + std::to_string(kMaxHostId) + " bytes");
  }
  std::vector<char> mine(kMaxHostId + 1, '\0'), all((kMaxHostId + 1) * size);
  std::memcpy(mine.data(), host_id.data(), host_id.size());
  Status s = Check(MPI_Allgather(mine.data(), kMaxHostId + 1, MPI_CHAR, all.data(), kMaxHostId + 1,
                                 MPI_CHAR, w),
                   "MPI_Allgather (host ids)");
  if (!s.ok()) return s;
  int color = 0;  // the lowest rank on this host
  while (std::memcmp(&all[color * (kMaxHostId + 1)], mine.data(), kMaxHostId + 1) != 0) ++color;
  return Check(MPI_Comm_split(w, color, rank, &Comm(local)), "MPI_Comm_split (hosts)");
}

LayerPlan PlanLayers(const std::vector<RankPlace>& ranks) {
  LayerPlan plan;
  const int size = static_cast<int>(ranks.size());
  int hosts = 0;
  bool shared = true, even = true, crowded = false;  // crowded: a host of several ranks
  for (const RankPlace& p : ranks) {
    if (p.local_rank == 0) ++hosts;
    shared = shared && p.shared_memory;
    even = even && p.local_size == ranks[0].local_size;
    crowded = crowded || p.local_size > 1;
  }
  // Every knob must agree: the layers are collective.
  const std::pair<const char*, int RankPlace::*> knobs[] = {
      {"HVDLITE_HIERARCHICAL_ALLREDUCE", &RankPlace::hierarchical_allreduce},
      {"HVDLITE_HIERARCHICAL_ALLGATHER", &RankPlace::hierarchical_allgather},
      {"HVDLITE_HIERARCHICAL_BROADCAST", &RankPlace::hierarchical_broadcast}};
  for (const auto& knob : knobs) {
    std::vector<std::string> values;
    for (const RankPlace& p : ranks) {
      values.push_back(p.*knob.second < 0 ? "unset" : std::to_string(p.*knob.second));
    }
    std::string diff = Disagreement(values);
    if (!diff.empty()) {
      plan.error = std::string(knob.first) + " must be the same on every rank: " + diff;
      return plan;
    }
  }
  if (size < 2) return plan;
  // Allgather and broadcast go through the hosts' leaders, which works for any number of
  // ranks per host and any placement; with one rank per host it would be the flat one.
  const bool leaders_pay = hosts > 1 && crowded;
  plan.hierarchical_allgather = leaders_pay && ranks[0].hierarchical_allgather != 0;
  plan.hierarchical_broadcast = leaders_pay && ranks[0].hierarchical_broadcast != 0;
  if (plan.hierarchical_allgather || plan.hierarchical_broadcast) {
    std::vector<int> host_index(size, -1);
    for (int r = 0; r < size; ++r) {
      const int leader = ranks[r].host;
      if (host_index[leader] < 0) {
        host_index[leader] = static_cast<int>(plan.hosts.size());
        plan.hosts.emplace_back();
      }
      plan.hosts[host_index[leader]].push_back(r);
    }
  }
  if (hosts == 1) {
    plan.world_shared_memory = shared;
    return plan;
  }
  const int knob_value = ranks[0].hierarchical_allreduce;
  if (knob_value == 0) return plan;
  if (!crowded) return plan;  // one rank per host: the hierarchy is the flat allreduce
  if (!shared) {
    if (knob_value == 1) {
      plan.notice = "hierarchical allreduce reduces within a host through shared memory, which "
                    "HVDLITE_SHM_ALLREDUCE=0 turns off: allreduce goes flat through MPI";
    }
    return plan;
  }
  // Hosts of one size reduce in shards across hosts; others through their leaders.
  (even ? plan.hierarchical_allreduce : plan.leader_allreduce) = true;
  return plan;
}

std::unique_ptr<HostLayer> HostLayer::Open(void* comm, int global_rank) {
  std::unique_ptr<HostLayer> layer(new HostLayer());
  layer->comm_ = comm;
  MPI_Comm local = Comm(comm);
  MPI_Comm_set_errhandler(local, MPI_ERRORS_RETURN);
  MPI_Comm_rank(local, &layer->rank_);
  MPI_Comm_size(local, &layer->size_);
  MPI_Win* win = new MPI_Win(MPI_WIN_NULL);
  void* mine = nullptr;
  int rc = MPI_Win_allocate_shared(ShmCollectives::kSegmentBytes, 1, MPI_INFO_NULL, local, &mine, win);
  // Whether every rank got its segment: all use it or none does.
  int ok = rc == MPI_SUCCESS ? 1 : 0, all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, local);
  if (!all_ok) {
    if (rc == MPI_SUCCESS) MPI_Win_free(win);
    delete win;
    HVDLITE_LOG(WARNING) << "no shared-memory window for the allreduce ("
                         << (rc == MPI_SUCCESS ? "on another rank" : Check(rc, "MPI_Win_allocate_shared").message())
                         << "); using MPI_Allreduce";
    layer->Close(true);
    return nullptr;
  }
  std::vector<uint8_t*> segments(layer->size_);
  for (int k = 0; k < layer->size_; ++k) {
    MPI_Aint bytes = 0;
    int disp = 0;
    void* base = nullptr;
    MPI_Win_shared_query(*win, k, &bytes, &disp, &base);
    segments[k] = static_cast<uint8_t*>(base);
  }
  // Each rank's control area: the barrier's state (rank 0's) and its Allreduce progress.
  std::memset(segments[layer->rank_], 0, ShmCollectives::kControlBytes);
  int64_t pid = static_cast<int64_t>(getpid());
  std::vector<int64_t> pids(layer->size_);
  MPI_Allgather(&pid, 1, MPI_INT64_T, pids.data(), 1, MPI_INT64_T, local);  // also a barrier
  std::vector<int> global_ranks(layer->size_);
  MPI_Allgather(&global_rank, 1, MPI_INT, global_ranks.data(), 1, MPI_INT, local);
  layer->window_ = win;
  layer->shm_.reset(new ShmCollectives(layer->rank_, std::move(segments), std::move(pids),
                                       std::move(global_ranks)));
  return layer;
}

HostLayer::~HostLayer() { Close(false); }

void HostLayer::Close(bool collective) {
  shm_.reset();
  if (window_) {
    if (collective) MPI_Win_free(static_cast<MPI_Win*>(window_));
    delete static_cast<MPI_Win*>(window_);
    window_ = nullptr;
  }
  if (comm_) {
    if (collective && Comm(comm_) != MPI_COMM_NULL) MPI_Comm_free(&Comm(comm_));
    delete static_cast<MPI_Comm*>(comm_);
    comm_ = nullptr;
  }
}

CommLayer::CommLayer(void* comm) : comm_(comm) {
  MPI_Comm_set_errhandler(Comm(comm_), MPI_ERRORS_RETURN);
  MPI_Comm_rank(Comm(comm_), &rank_);
  MPI_Comm_size(Comm(comm_), &size_);
}

void CommLayer::CloseComm(bool collective) {
  if (!comm_) return;
  if (collective && Comm(comm_) != MPI_COMM_NULL) MPI_Comm_free(&Comm(comm_));
  delete static_cast<MPI_Comm*>(comm_);
  comm_ = nullptr;
}

void CrossLayer::Close(bool collective) {
  for (Ring& ring : rings_) {
    for (void* r : ring.requests) delete static_cast<MPI_Request*>(r);
    ring.requests.clear();
    ring.steps = 0;
  }
  CloseComm(collective);
}

uint8_t* CrossLayer::Segment(const Ring& ring, int k) const {
  return ring.buf + ring.count * k / size_ * ElementSize(ring.dtype);
}

int64_t CrossLayer::SegmentBytes(const Ring& ring, int k) const {
  return (ring.count * (k + 1) / size_ - ring.count * k / size_) * ElementSize(ring.dtype);
}

// Ring steps. Reduce-scatter, step s: this rank passes segment rank - s on and adds the
// previous rank's partial result of segment rank - s - 1 into its own; after size - 1
// steps it holds segment rank + 1 reduced over every rank. Allgather, step s: the
// reduced segment rank + 1 - s goes on, segment rank - s arrives.
Status CrossLayer::Post(int slot) {
  Ring& ring = rings_[slot];
  const bool reducing = ring.step < size_ - 1;
  const int s = reducing ? ring.step : ring.step - (size_ - 1);
  const int out = (rank_ - s + (reducing ? 0 : 1) + size_) % size_;
  const int in = (rank_ - s - (reducing ? 1 : 0) + 2 * size_) % size_;
  const uint8_t* send = Segment(ring, out);
  uint8_t* recv = reducing ? ring.scratch.data() : Segment(ring, in);
  const int64_t send_bytes = SegmentBytes(ring, out), recv_bytes = SegmentBytes(ring, in);
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  for (void* r : ring.requests) delete static_cast<MPI_Request*>(r);
  ring.requests.clear();
  // One message of at most kMaxMessage bytes from `done` on, if any are left.
  auto post = [&](bool receiving, int64_t done) {
    const int64_t total = receiving ? recv_bytes : send_bytes;
    if (done >= total) return Status::OK();
    MPI_Request* r = new MPI_Request;
    ring.requests.push_back(r);
    const int n = static_cast<int>(std::min(kMaxMessage, total - done));
    InMpiCall in_mpi(receiving ? "MPI_Irecv (cross-host ring)" : "MPI_Isend (cross-host ring)");
    return receiving ? Check(MPI_Irecv(recv + done, n, MPI_BYTE, prev, slot, Comm(comm_), r), "MPI_Irecv (cross-host ring)")
                     : Check(MPI_Isend(send + done, n, MPI_BYTE, next, slot, Comm(comm_), r), "MPI_Isend (cross-host ring)");
  };
  for (int64_t done = 0; done < recv_bytes || done < send_bytes; done += kMaxMessage) {
    Status st = post(true, done);
    if (st.ok()) st = post(false, done);
    if (!st.ok()) return st;
  }
  return Status::OK();
}

Status CrossLayer::PostDirect(int slot) {
  Ring& ring = rings_[slot];
  const int64_t bytes = ring.count * ElementSize(ring.dtype);
  for (void* r : ring.requests) delete static_cast<MPI_Request*>(r);
  ring.requests.clear();
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    for (bool receiving : {true, false}) {
      MPI_Request* r = new MPI_Request;
      ring.requests.push_back(r);
      InMpiCall in_mpi(receiving ? "MPI_Irecv (cross-host allreduce)" : "MPI_Isend (cross-host allreduce)");
      Status st = receiving ? Check(MPI_Irecv(ring.scratch.data() + peer * bytes, static_cast<int>(bytes), MPI_BYTE,
                                              peer, slot, Comm(comm_), r),
                                    "MPI_Irecv (cross-host allreduce)")
                            : Check(MPI_Isend(ring.buf, static_cast<int>(bytes), MPI_BYTE, peer, slot,
                                              Comm(comm_), r),
                                    "MPI_Isend (cross-host allreduce)");
      if (!st.ok()) return st;
    }
  }
  return Status::OK();
}

Status CrossLayer::Start(int slot, void* buf, int64_t count, int32_t dtype, int32_t reduce_op) {
  Ring& ring = rings_[slot];
  ring.buf = static_cast<uint8_t*>(buf);
  ring.count = count;
  ring.dtype = dtype;
  ring.reduce_op = reduce_op;
  ring.step = 0;
  const int64_t bytes = count * ElementSize(dtype);
  ring.direct = bytes <= kDirectMaxBytes;
  ring.steps = size_ == 1 || count == 0 ? 0 : ring.direct ? 1 : 2 * (size_ - 1);
  if (done(slot)) return Status::OK();
  if (ring.direct) {
    ring.scratch.resize(bytes * size_);
    std::memcpy(ring.scratch.data() + rank_ * bytes, buf, bytes);
    return PostDirect(slot);
  }
  ring.scratch.resize(SegmentBytes(ring, size_ - 1));  // the longest segment
  return Post(slot);
}

Status CrossLayer::ProgressRing(int slot) {
  Ring& ring = rings_[slot];
  if (done(slot)) return Status::OK();
  for (void* r : ring.requests) {
    int flag = 0;
    InMpiCall in_mpi("MPI_Test (cross-host ring)");
    Status st = Check(MPI_Test(static_cast<MPI_Request*>(r), &flag, MPI_STATUS_IGNORE),
                      "MPI_Test (cross-host ring)");
    if (!st.ok() || !flag) return st;
  }
  if (ring.direct) {
    const int64_t bytes = ring.count * ElementSize(ring.dtype);
    std::vector<const uint8_t*> parts(size_);
    for (int k = 0; k < size_; ++k) parts[k] = ring.scratch.data() + k * bytes;
    ReduceElements(ring.buf, parts, ring.count, ring.dtype, ring.reduce_op);
  } else if (ring.step < size_ - 1) {
    const int in = (rank_ - ring.step - 1 + size_) % size_;
    const std::vector<const uint8_t*> parts = {Segment(ring, in), ring.scratch.data()};
    ReduceElements(Segment(ring, in), parts, SegmentBytes(ring, in) / ElementSize(ring.dtype),
                   ring.dtype, ring.reduce_op);
  }
  ++ring.step;
  return done(slot) ? Status::OK() : Post(slot);
}

Status CrossLayer::Progress() {
  for (int slot = 0; slot < kSlots; ++slot) {
    Status st = ProgressRing(slot);
    if (!st.ok()) return st;
  }
  return Status::OK();
}

Status CrossLayer::Wait(int slot) {
  // A step moves megabytes at network speed, and MPI moves it on only in the polls. A
  // direct one's answer is due within a network trip, which a sleep's wake-up (20-60
  // us) would add to, while a caller waits for it.
  PollBackoff backoff(PollBackoff::kDataMaxSleep, caller_waiting_ && rings_[slot].direct
                                                      ? PollBackoff::kCallerSpin
                                                      : PollBackoff::kSpin);
  while (!done(slot)) {
    const int steps = rings_[0].step + rings_[1].step;
    Status st = Progress();
    if (!st.ok()) return st;
    if (rings_[0].step + rings_[1].step != steps) {
      backoff.Progressed();
    } else {
      backoff.Pause();
    }
  }
  return Status::OK();
}

Status CrossLayer::Allreduce(void* buf, int64_t count, int32_t dtype, int32_t reduce_op) {
  Status st = Start(0, buf, count, dtype, reduce_op);
  return st.ok() ? Wait(0) : st;
}

void Pending::Clear() {
  // Requests left only after a failure, which ends the job's collectives: MPI may not
  // free a nonblocking collective's request, so it keeps what it has.
  for (void* r : requests_) delete static_cast<MPI_Request*>(r);
  requests_.clear();
}

Status Pending::Test(bool* done) {
  InMpiCall in_mpi("MPI_Testall (hierarchical collective)");
  *done = true;
  for (auto it = requests_.begin(); it != requests_.end();) {
    int flag = 0;
    Status st = Check(MPI_Test(static_cast<MPI_Request*>(*it), &flag, MPI_STATUS_IGNORE),
                      "MPI_Test (hierarchical collective)");
    if (!st.ok()) return st;
    if (!flag) {
      *done = false;
      return Status::OK();  // in order: a later request cannot be needed before this one
    }
    delete static_cast<MPI_Request*>(*it);
    it = requests_.erase(it);
  }
  return Status::OK();
}

namespace {

// Byte counts and offsets as MPI's ints; more than 2 GiB in one collective is refused,
// as the flat one refuses it.
Status IntCounts(const std::vector<int64_t>& bytes, const std::vector<int64_t>& displs,
                 std::vector<int>* counts, std::vector<int>* offsets) {
  for (size_t k = 0; k < bytes.size(); ++k) {
    if (bytes[k] + displs[k] > INT32_MAX) {
      return InvalidArgument("allgather: more than 2 GiB per collective is not supported yet");
    }
    counts->push_back(static_cast<int>(bytes[k]));
    offsets->push_back(static_cast<int>(displs[k]));
  }
  return Status::OK();
}

}  // namespace

Status GroupLayer::Gatherv(const void* in, int64_t in_bytes, void* out,
                           const std::vector<int64_t>& bytes, const std::vector<int64_t>& displs,
                           Pending* pending) {
  std::vector<int> counts, offsets;
  Status st = IntCounts(bytes, displs, &counts, &offsets);
  if (!st.ok()) return st;
  InMpiCall in_mpi("MPI_Igatherv (within the host)");
  MPI_Request* r = new MPI_Request(MPI_REQUEST_NULL);
  pending->Add(r);
  return Check(MPI_Igatherv(in, static_cast<int>(in_bytes), MPI_BYTE, out, counts.data(),
                            offsets.data(), MPI_BYTE, 0, Comm(comm_), r),
               "MPI_Igatherv (within the host)");
}

Status GroupLayer::Allgatherv(void* buf, const std::vector<int64_t>& bytes,
                              const std::vector<int64_t>& displs, Pending* pending) {
  std::vector<int> counts, offsets;
  Status st = IntCounts(bytes, displs, &counts, &offsets);
  if (!st.ok()) return st;
  InMpiCall in_mpi("MPI_Iallgatherv (across hosts)");
  MPI_Request* r = new MPI_Request(MPI_REQUEST_NULL);
  pending->Add(r);
  return Check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_BYTE, buf, counts.data(), offsets.data(),
                               MPI_BYTE, Comm(comm_), r),
               "MPI_Iallgatherv (across hosts)");
}

Status GroupLayer::Bcast(void* buf, int64_t bytes, int root, Pending* pending) {
  InMpiCall in_mpi("MPI_Ibcast (hierarchical)");
  for (int64_t done = 0; done < bytes; done += kMaxMessage) {
    MPI_Request* r = new MPI_Request(MPI_REQUEST_NULL);
    pending->Add(r);
    const int n = static_cast<int>(std::min(kMaxMessage, bytes - done));
    Status st = Check(MPI_Ibcast(static_cast<uint8_t*>(buf) + done, n, MPI_BYTE, root,
                                 Comm(comm_), r),
                      "MPI_Ibcast (hierarchical)");
    if (!st.ok()) return st;
  }
  return Status::OK();
}

int64_t PipelineChunks(int64_t bytes) {
  constexpr int64_t kMaxChunk = 1 << 20, kMinChunk = 256 << 10, kMinChunks = 8;
  const int64_t chunk = std::max(kMinChunk, std::min(kMaxChunk, bytes / kMinChunks));
  return std::max<int64_t>(1, (bytes + chunk - 1) / chunk);
}

Status RunPipeline(int64_t chunks, const std::vector<PipelineStage>& stages) {
  const int count = static_cast<int>(stages.size());
  // Per chunk: stages started, stages done; the started one's requests.
  std::vector<int> started(chunks, 0), finished(chunks, 0);
  std::vector<Pending> pending(chunks);
  int64_t first = 0;  // chunks before it are through every stage
  // MPI moves data on only in the polls.
  PollBackoff backoff(PollBackoff::kDataMaxSleep);
  while (first < chunks) {
    bool progressed = false;
    for (int64_t k = first; k < chunks; ++k) {
      if (started[k] > finished[k]) {
        bool done = false;
        Status st = pending[k].Test(&done);
        if (!st.ok()) return st;
        if (done) {
          ++finished[k];
          progressed = true;
        }
      }
      // Start stage started[k] of chunk k once its previous stage is done and chunk
      // k - 1 has started it; stages with nothing for this rank are done at once.
      while (started[k] == finished[k] && started[k] < count &&
             (k == first || started[k - 1] > started[k])) {
        Status st = stages[started[k]](k, &pending[k]);
        if (!st.ok()) return st;
        ++started[k];
        if (pending[k].empty()) ++finished[k];
        progressed = true;
      }
      if (started[k] == 0) break;  // later chunks wait for this one to start
    }
    while (first < chunks && finished[first] == count) ++first;
    if (first >= chunks) break;
    if (progressed) {
      backoff.Progressed();
    } else {
      backoff.Pause();
    }
  }
  return Status::OK();
}

}  // namespace hvdlite
