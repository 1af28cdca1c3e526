#include "topology_layers.h"

#include <mpi.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "mpi_fault_guard.h"

namespace hvdlite {
namespace {

MPI_Comm& Comm(void* p) { return *static_cast<MPI_Comm*>(p); }

Status Check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return Status::OK();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return Status(HVDLITE_ERR_MPI, std::string(what) + " failed: " + std::string(text, len));
}

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
  std::vector<std::string> knob;
  int hosts = 0;
  bool shared = true, even = true;
  for (const RankPlace& p : ranks) {
    knob.push_back(p.hierarchical_allreduce < 0 ? "unset" : std::to_string(p.hierarchical_allreduce));
    if (p.local_rank == 0) ++hosts;
    shared = shared && p.shared_memory;
    even = even && p.local_size == ranks[0].local_size;
  }
  std::string diff = Disagreement(knob);
  if (!diff.empty()) {
    plan.error = "HVDLITE_HIERARCHICAL_ALLREDUCE must be the same on every rank: " + diff;
    return plan;
  }
  if (size < 2) return plan;
  if (hosts == 1) {
    plan.world_shared_memory = shared;
    return plan;
  }
  const int knob_value = ranks[0].hierarchical_allreduce;
  if (knob_value == 0) return plan;
  if (!even) {
    std::string sizes;
    for (const RankPlace& p : ranks) {
      if (p.local_rank == 0) sizes += (sizes.empty() ? "" : ", ") + std::to_string(p.local_size);
    }
    if (knob_value == 1) {
      plan.notice = "hierarchical allreduce needs the same number of ranks on every host (these "
                    "have " + sizes + "): allreduce goes flat through MPI";
    }
    return plan;
  }
  if (ranks[0].local_size == 1) return plan;  // one rank per host: the hierarchy is flat
  if (!shared) {
    if (knob_value == 1) {
      plan.notice = "hierarchical allreduce reduces within a host through shared memory, which "
                    "HVDLITE_SHM_ALLREDUCE=0 turns off: allreduce goes flat through MPI";
    }
    return plan;
  }
  plan.hierarchical_allreduce = true;
  return plan;
}

std::unique_ptr<HostLayer> HostLayer::Open(void* comm) {
  std::unique_ptr<HostLayer> layer(new HostLayer());
  layer->comm_ = comm;
  MPI_Comm local = Comm(comm);
  MPI_Comm_set_errhandler(local, MPI_ERRORS_RETURN);
  MPI_Comm_rank(local, &layer->rank_);
  MPI_Comm_size(local, &layer->size_);
  MPI_Win* win = new MPI_Win(MPI_WIN_NULL);
  void* mine = nullptr;
  int rc = MPI_Win_allocate_shared(ShmAllreduce::kSegmentBytes, 1, MPI_INFO_NULL, local, &mine, win);
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
  std::memset(segments[layer->rank_], 0, ShmAllreduce::kControlBytes);
  int64_t pid = static_cast<int64_t>(getpid());
  std::vector<int64_t> pids(layer->size_);
  MPI_Allgather(&pid, 1, MPI_INT64_T, pids.data(), 1, MPI_INT64_T, local);  // also a barrier
  layer->window_ = win;
  layer->shm_.reset(new ShmAllreduce(layer->rank_, std::move(segments), std::move(pids)));
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

CrossLayer::CrossLayer(void* comm) : comm_(comm) {
  MPI_Comm_set_errhandler(Comm(comm_), MPI_ERRORS_RETURN);
  MPI_Comm_rank(Comm(comm_), &rank_);
  MPI_Comm_size(Comm(comm_), &size_);
}

CrossLayer::~CrossLayer() { Close(false); }

void CrossLayer::Close(bool collective) {
  for (void* r : requests_) delete static_cast<MPI_Request*>(r);
  requests_.clear();
  steps_ = 0;
  if (!comm_) return;
  if (collective && Comm(comm_) != MPI_COMM_NULL) MPI_Comm_free(&Comm(comm_));
  delete static_cast<MPI_Comm*>(comm_);
  comm_ = nullptr;
}

uint8_t* CrossLayer::Segment(int k) const { return buf_ + count_ * k / size_ * ElementSize(dtype_); }

int64_t CrossLayer::SegmentBytes(int k) const {
  return (count_ * (k + 1) / size_ - count_ * k / size_) * ElementSize(dtype_);
}

// Ring steps. Reduce-scatter, step s: this rank passes segment rank - s on and adds the
// previous rank's partial result of segment rank - s - 1 into its own; after size - 1
// steps it holds segment rank + 1 reduced over every rank. Allgather, step s: the
// reduced segment rank + 1 - s goes on, segment rank - s arrives.
Status CrossLayer::Post() {
  const bool reducing = step_ < size_ - 1;
  const int s = reducing ? step_ : step_ - (size_ - 1);
  const int out = (rank_ - s + (reducing ? 0 : 1) + size_) % size_;
  const int in = (rank_ - s - (reducing ? 1 : 0) + 2 * size_) % size_;
  const uint8_t* send = Segment(out);
  uint8_t* recv = reducing ? scratch_.data() : Segment(in);
  const int64_t send_bytes = SegmentBytes(out), recv_bytes = SegmentBytes(in);
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  for (void* r : requests_) delete static_cast<MPI_Request*>(r);
  requests_.clear();
  // One message of at most kMaxMessage bytes from `done` on, if any are left.
  auto post = [&](bool receiving, int64_t done) {
    const int64_t total = receiving ? recv_bytes : send_bytes;
    if (done >= total) return Status::OK();
    MPI_Request* r = new MPI_Request;
    requests_.push_back(r);
    const int n = static_cast<int>(std::min(kMaxMessage, total - done));
    InMpiCall in_mpi(receiving ? "MPI_Irecv (cross-host ring)" : "MPI_Isend (cross-host ring)");
    return receiving ? Check(MPI_Irecv(recv + done, n, MPI_BYTE, prev, 0, Comm(comm_), r), "MPI_Irecv (cross-host ring)")
                     : Check(MPI_Isend(send + done, n, MPI_BYTE, next, 0, Comm(comm_), r), "MPI_Isend (cross-host ring)");
  };
  for (int64_t done = 0; done < recv_bytes || done < send_bytes; done += kMaxMessage) {
    Status st = post(true, done);
    if (st.ok()) st = post(false, done);
    if (!st.ok()) return st;
  }
  return Status::OK();
}

Status CrossLayer::Start(void* buf, int64_t count, int32_t dtype, int32_t reduce_op) {
  buf_ = static_cast<uint8_t*>(buf);
  count_ = count;
  dtype_ = dtype;
  reduce_op_ = reduce_op;
  step_ = 0;
  steps_ = size_ == 1 || count == 0 ? 0 : 2 * (size_ - 1);
  if (done()) return Status::OK();
  scratch_.resize(SegmentBytes(size_ - 1));  // the longest segment
  return Post();
}

Status CrossLayer::Progress() {
  if (done()) return Status::OK();
  for (void* r : requests_) {
    int flag = 0;
    InMpiCall in_mpi("MPI_Test (cross-host ring)");
    Status st = Check(MPI_Test(static_cast<MPI_Request*>(r), &flag, MPI_STATUS_IGNORE),
                      "MPI_Test (cross-host ring)");
    if (!st.ok() || !flag) return st;
  }
  if (step_ < size_ - 1) {
    const int in = (rank_ - step_ - 1 + size_) % size_;
    const std::vector<const uint8_t*> parts = {Segment(in), scratch_.data()};
    ReduceElements(Segment(in), parts, SegmentBytes(in) / ElementSize(dtype_), dtype_, reduce_op_);
  }
  ++step_;
  return done() ? Status::OK() : Post();
}

Status CrossLayer::Wait() {
  // A step moves megabytes at network speed: poll briefly, then sleep between polls
  // (20 us doubling to 200 us; each poll lets MPI push more into the socket, whose
  // buffer holds far more than the link carries in 200 us).
  auto sleep = std::chrono::microseconds(20);
  const auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
  while (!done()) {
    const int step = step_;
    Status st = Progress();
    if (!st.ok()) return st;
    if (step_ != step) {
      sleep = std::chrono::microseconds(20);
    } else if (std::chrono::steady_clock::now() >= spin_end) {
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(200));
    }
  }
  return Status::OK();
}

Status CrossLayer::Allreduce(void* buf, int64_t count, int32_t dtype, int32_t reduce_op) {
  Status st = Start(buf, count, dtype, reduce_op);
  return st.ok() ? Wait() : st;
}

}  // namespace hvdlite
