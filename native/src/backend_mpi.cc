#include "backend_mpi.h"

#include <mpi.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <thread>

#include "half.h"
#include "mpi_fault_guard.h"

namespace hvdlite {
namespace {

MPI_Comm& Comm(void* p) { return *static_cast<MPI_Comm*>(p); }

// Elementwise reductions over 16-bit floats, which MPI has no type for.
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), int kOp>
void HalfReduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = ToF(a[i]), y = ToF(b[i]), r;
    switch (kOp) {
      case HVDLITE_MIN: r = std::min(x, y); break;
      case HVDLITE_MAX: r = std::max(x, y); break;
      case HVDLITE_PRODUCT: r = x * y; break;
      default: r = x + y; break;
    }
    b[i] = FromF(r);
  }
}

MPI_User_function* kHalfFns[2][5] = {
    {HalfReduce<HalfToFloat, FloatToHalf, HVDLITE_AVERAGE>, HalfReduce<HalfToFloat, FloatToHalf, HVDLITE_SUM>,
     HalfReduce<HalfToFloat, FloatToHalf, HVDLITE_MIN>, HalfReduce<HalfToFloat, FloatToHalf, HVDLITE_MAX>,
     HalfReduce<HalfToFloat, FloatToHalf, HVDLITE_PRODUCT>},
    {HalfReduce<Bf16ToFloat, FloatToBf16, HVDLITE_AVERAGE>, HalfReduce<Bf16ToFloat, FloatToBf16, HVDLITE_SUM>,
     HalfReduce<Bf16ToFloat, FloatToBf16, HVDLITE_MIN>, HalfReduce<Bf16ToFloat, FloatToBf16, HVDLITE_MAX>,
     HalfReduce<Bf16ToFloat, FloatToBf16, HVDLITE_PRODUCT>}};

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

}  // namespace

Status MpiBackend::Check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return Status::OK();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return Status(HVDLITE_ERR_MPI, std::string(what) + " failed: " + std::string(text, len));
}

Status MpiBackend::Init(int64_t comm_f2c, bool thread_multiple, bool shared_memory,
                        MpiTopology* topo) {
  InstallMpiFaultGuard();
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = 0;
  if (!initialized) {
    // This thread initializes MPI and makes every MPI call, so FUNNELED is enough.
    int required = thread_multiple ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED;
    int rc = MPI_Init_thread(nullptr, nullptr, required, &provided);
    if (rc != MPI_SUCCESS) return Check(rc, "MPI_Init_thread");
    initialized_mpi_ = true;
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
  topo->threads_multiple = provided == MPI_THREAD_MULTIPLE;
  MPI_Comm base = comm_f2c < 0 ? MPI_COMM_WORLD : MPI_Comm_f2c(static_cast<MPI_Fint>(comm_f2c));
  comm_ = new MPI_Comm(MPI_COMM_NULL);
  Status s = Check(MPI_Comm_dup(base, &Comm(comm_)), "MPI_Comm_dup");
  if (!s.ok()) return s;
  Attach(shared_memory, topo);
  return Status::OK();
}

Status MpiBackend::InitSubset(const MpiBackend& parent, bool member, bool shared_memory) {
  int parent_rank = 0;
  MPI_Comm_rank(Comm(parent.comm_), &parent_rank);
  MPI_Comm sub = MPI_COMM_NULL;
  Status s = Check(MPI_Comm_split(Comm(parent.comm_), member ? 0 : MPI_UNDEFINED, parent_rank, &sub),
                   "MPI_Comm_split (process set)");
  if (!s.ok() || !member) return s;
  comm_ = new MPI_Comm(sub);
  MpiTopology topo;
  Attach(shared_memory, &topo);
  return Status::OK();
}

void MpiBackend::Attach(bool shared_memory, MpiTopology* topo) {
  // Failures come back as codes that become statuses instead of aborting the job.
  MPI_Comm_set_errhandler(Comm(comm_), MPI_ERRORS_RETURN);
  MPI_Comm_rank(Comm(comm_), &topo->rank);
  MPI_Comm_size(Comm(comm_), &topo->size);
  MPI_Comm local, cross;
  MPI_Comm_split_type(Comm(comm_), MPI_COMM_TYPE_SHARED, topo->rank, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &topo->local_rank);
  MPI_Comm_size(local, &topo->local_size);
  MPI_Comm_split(Comm(comm_), topo->local_rank, topo->rank, &cross);
  MPI_Comm_rank(cross, &topo->cross_rank);
  MPI_Comm_size(cross, &topo->cross_size);
  // Every rank decides alike (setting it up is collective): the sizes are the same
  // everywhere when all share a machine, and HVDLITE_SHM_ALLREDUCE=0 on any rank turns
  // it off on all.
  if (topo->size > 1 && topo->local_size == topo->size) {
    int want = shared_memory ? 1 : 0, all_want = 0;
    MPI_Allreduce(&want, &all_want, 1, MPI_INT, MPI_MIN, local);
    if (all_want) {
      SetUpSharedMemory(&local, topo->rank);
    } else if (want) {
      HVDLITE_LOG(WARNING) << "HVDLITE_SHM_ALLREDUCE=0 on another rank: every rank "
                              "allreduces through MPI";
    }
  }
  MPI_Comm_free(&local);
  MPI_Comm_free(&cross);
  for (int kind = 0; kind < 2; ++kind) {
    for (int op = 0; op < 5; ++op) {
      MPI_Op* mop = new MPI_Op;
      MPI_Op_create(kHalfFns[kind][op], 1, mop);
      ops_.push_back(mop);
    }
  }
}

void MpiBackend::SetUpSharedMemory(void* local_comm, int rank) {
  MPI_Comm local = *static_cast<MPI_Comm*>(local_comm);
  MPI_Comm_set_errhandler(local, MPI_ERRORS_RETURN);
  int size = 0;
  MPI_Comm_size(local, &size);
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
    return;
  }
  std::vector<uint8_t*> segments(size);
  for (int k = 0; k < size; ++k) {
    MPI_Aint bytes = 0;
    int disp = 0;
    void* base = nullptr;
    MPI_Win_shared_query(*win, k, &bytes, &disp, &base);
    segments[k] = static_cast<uint8_t*>(base);
  }
  if (rank == 0) std::memset(segments[0], 0, ShmAllreduce::kControlBytes);  // the barrier's state
  int64_t pid = static_cast<int64_t>(getpid());
  std::vector<int64_t> pids(size);
  MPI_Allgather(&pid, 1, MPI_INT64_T, pids.data(), 1, MPI_INT64_T, local);  // also a barrier
  window_ = win;
  shm_.reset(new ShmAllreduce(rank, std::move(segments), std::move(pids)));
}

void MpiBackend::Shutdown(bool finalize) {
  shm_.reset();
  if (window_) {
    // Freeing is collective: only on a shutdown every rank takes part in.
    if (finalize) MPI_Win_free(static_cast<MPI_Win*>(window_));
    delete static_cast<MPI_Win*>(window_);
    window_ = nullptr;
  }
  if (finalize) {
    for (void* p : ops_) MPI_Op_free(static_cast<MPI_Op*>(p));
    if (comm_ && Comm(comm_) != MPI_COMM_NULL) MPI_Comm_free(&Comm(comm_));
    if (initialized_mpi_) MPI_Finalize();
  }
  for (void* p : ops_) delete static_cast<MPI_Op*>(p);
  ops_.clear();
  delete static_cast<MPI_Comm*>(comm_);
  comm_ = nullptr;
}

Status MpiBackend::WaitBackoff(void* request, const char* what) {
  InMpiCall in_mpi(what);
  MPI_Request* req = static_cast<MPI_Request*>(request);
  // Spin for up to 50 us (a peer in step with us is usually there by then), then sleep
  // 20 us doubling to 1 ms: a peer that is still computing costs us almost no CPU.
  int flag = 0;
  auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
  do {
    int rc = MPI_Test(req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return Check(rc, what);
    if (flag) return Status::OK();
  } while (std::chrono::steady_clock::now() < spin_end);
  auto sleep = std::chrono::microseconds(20);
  while (true) {
    std::this_thread::sleep_for(sleep);
    int rc = MPI_Test(req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return Check(rc, what);
    if (flag) return Status::OK();
    sleep = std::min(sleep * 2, std::chrono::microseconds(1000));
  }
}

Status MpiBackend::AndBits(std::vector<uint64_t>* bits) {
  const int64_t words = static_cast<int64_t>(bits->size());
  if (shm_ && words <= ShmAllreduce::kMaxBitsWords) return shm_->AndBits(bits->data(), words);
  InMpiCall in_mpi("MPI_Iallreduce (coordination)");
  MPI_Request req;
  Status s = Check(MPI_Iallreduce(MPI_IN_PLACE, bits->data(), static_cast<int>(bits->size()),
                                  MPI_UINT64_T, MPI_BAND, Comm(comm_), &req),
                   "MPI_Iallreduce (coordination)");
  if (!s.ok()) return s;
  return WaitBackoff(&req, "MPI_Iallreduce (coordination)");
}

Status MpiBackend::GatherBlobs(const std::vector<uint8_t>& mine,
                               std::vector<std::vector<uint8_t>>* all) {
  InMpiCall in_mpi("MPI_Igather (negotiation)");
  int rank, size;
  MPI_Comm_rank(Comm(comm_), &rank);
  MPI_Comm_size(Comm(comm_), &size);
  int my_len = static_cast<int>(mine.size());
  std::vector<int> lens(rank == 0 ? size : 0);
  MPI_Request req;
  Status s = Check(MPI_Igather(&my_len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, Comm(comm_), &req),
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

Status MpiBackend::BroadcastBlob(std::vector<uint8_t>* blob) {
  InMpiCall in_mpi("MPI_Ibcast (responses)");
  int64_t len = static_cast<int64_t>(blob->size());
  MPI_Request req;
  Status s = Check(MPI_Ibcast(&len, 1, MPI_INT64_T, 0, Comm(comm_), &req), "MPI_Ibcast (responses)");
  if (!s.ok() || !(s = WaitBackoff(&req, "MPI_Ibcast (responses)")).ok()) return s;
  blob->resize(len);
  if (len == 0) return Status::OK();
  s = Check(MPI_Ibcast(blob->data(), static_cast<int>(len), MPI_BYTE, 0, Comm(comm_), &req),
            "MPI_Ibcast (responses)");
  if (!s.ok()) return s;
  return WaitBackoff(&req, "MPI_Ibcast (responses)");
}

Status MpiBackend::Allreduce(const void* in, void* out, int64_t count, int32_t dtype,
                             int32_t reduce_op) {
  InMpiCall in_mpi("MPI_Allreduce");
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
    Status s = Check(MPI_Allreduce(send, dst + done * elem, static_cast<int>(n), type, op, Comm(comm_)),
                     "MPI_Allreduce");
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
  InMpiCall in_mpi("MPI_Allgatherv");
  std::vector<int> counts, displs;
  Status s = ToIntCounts(bytes_per_rank, &counts, &displs, "allgather");
  if (!s.ok()) return s;
  return Check(MPI_Allgatherv(in, static_cast<int>(in_bytes), MPI_BYTE, out, counts.data(),
                              displs.data(), MPI_BYTE, Comm(comm_)),
               "MPI_Allgatherv");
}

Status MpiBackend::Bcast(void* buf, int64_t nbytes, int root) {
  InMpiCall in_mpi("MPI_Bcast");
  char* p = static_cast<char*>(buf);
  for (int64_t done = 0; done < nbytes;) {
    int64_t n = std::min(kMaxChunk, nbytes - done);
    Status s = Check(MPI_Bcast(p + done, static_cast<int>(n), MPI_BYTE, root, Comm(comm_)),
                     "MPI_Bcast");
    if (!s.ok()) return s;
    done += n;
  }
  return Status::OK();
}

Status MpiBackend::Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                             const std::vector<int64_t>& recv_bytes) {
  InMpiCall in_mpi("MPI_Alltoallv");
  std::vector<int> sc, sd, rc, rd;
  Status s = ToIntCounts(send_bytes, &sc, &sd, "alltoall");
  if (!s.ok() || !(s = ToIntCounts(recv_bytes, &rc, &rd, "alltoall")).ok()) return s;
  return Check(MPI_Alltoallv(in, sc.data(), sd.data(), MPI_BYTE, out, rc.data(), rd.data(),
                             MPI_BYTE, Comm(comm_)),
               "MPI_Alltoallv");
}

Status MpiBackend::ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts,
                                 int32_t dtype, int32_t reduce_op) {
  InMpiCall in_mpi("MPI_Reduce_scatter");
  std::vector<int> c, d;
  Status s = ToIntCounts(counts, &c, &d, "reducescatter");
  if (!s.ok()) return s;
  MPI_Op op = StandardOp(reduce_op);
  if (dtype == HVDLITE_FLOAT16 || dtype == HVDLITE_BFLOAT16) {
    op = *static_cast<MPI_Op*>(ops_[(dtype == HVDLITE_BFLOAT16 ? 5 : 0) + reduce_op]);
  }
  return Check(MPI_Reduce_scatter(in, out, c.data(), MpiType(dtype), op, Comm(comm_)),
               "MPI_Reduce_scatter");
}

Status MpiBackend::Barrier() {
  InMpiCall in_mpi("MPI_Ibarrier");
  MPI_Request req;
  Status s = Check(MPI_Ibarrier(Comm(comm_), &req), "MPI_Ibarrier");
  if (!s.ok()) return s;
  return WaitBackoff(&req, "MPI_Ibarrier");
}

std::string MpiBackend::LibraryVersion() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  return std::string(buf, len);
}

}  // namespace hvdlite
