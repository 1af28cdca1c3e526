#include "gpu/nccl_comm.h"

#include <cstring>

#include "common/half.h"

namespace hvdlite {
namespace gpu {

int NcclType(int32_t dtype) {
  switch (dtype) {
    case HVDLITE_UINT8: return kNcclUint8;
    case HVDLITE_INT8: return kNcclInt8;
    case HVDLITE_INT32: return kNcclInt32;
    case HVDLITE_INT64: return kNcclInt64;
    case HVDLITE_FLOAT16: return kNcclFloat16;
    case HVDLITE_BFLOAT16: return kNcclBfloat16;
    case HVDLITE_FLOAT32: return kNcclFloat32;
    case HVDLITE_FLOAT64: return kNcclFloat64;
  }
  return -1;
}

int NcclReduction(int32_t reduce_op) {
  switch (reduce_op) {
    case HVDLITE_SUM: return kNcclSum;
    case HVDLITE_MIN: return kNcclMin;
    case HVDLITE_MAX: return kNcclMax;
    case HVDLITE_PRODUCT: return kNcclProd;
  }
  return -1;
}

Status NcclComm::Check(int code, const char* what) const {
  if (code == 0) return Status::OK();
  return Status(HVDLITE_ERR_MPI, std::string("NCCL: ") + what + " failed: " + nccl_->GetErrorString(code) +
                                     " (error " + std::to_string(code) + ")");
}

Status NcclComm::Init(const NcclApi* nccl, Device* device, int rank, int size,
                      const std::function<Status(void*, int64_t)>& broadcast) {
  nccl_ = nccl;
  device_ = device;
  rank_ = rank;
  size_ = size;
  NcclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  Status s = rank == 0 ? Check(nccl_->GetUniqueId(&id), "ncclGetUniqueId") : Status::OK();
  // Every member takes part in the broadcast, also after a failure on rank 0 (its id is
  // then zeros, and NCCL's init fails on every rank instead of some waiting forever).
  Status b = broadcast(&id, sizeof(id));
  if (!b.ok()) return b;
  if (!s.ok()) return s;
  return Check(nccl_->CommInitRank(&comm_, size, id, rank), "ncclCommInitRank");
}

void NcclComm::Destroy() {
  if (comm_) nccl_->CommDestroy(comm_);
  comm_ = nullptr;
}

Status NcclComm::Reduction(int32_t dtype, int32_t reduce_op, double scale, int* op, bool* made) {
  *made = false;
  if (scale == 1.0) {
    *op = NcclReduction(reduce_op);
    return Status::OK();
  }
  // A scaled sum: NCCL multiplies each input by the scalar (of the tensor's type) first.
  union {
    double f64;
    float f32;
    uint16_t f16;
  } scalar;
  switch (dtype) {
    case HVDLITE_FLOAT64: scalar.f64 = scale; break;
    case HVDLITE_FLOAT32: scalar.f32 = static_cast<float>(scale); break;
    case HVDLITE_FLOAT16: scalar.f16 = FloatToHalf(static_cast<float>(scale)); break;
    case HVDLITE_BFLOAT16: scalar.f16 = FloatToBf16(static_cast<float>(scale)); break;
    default: return InvalidArgument("a scaled NCCL reduction of " + std::string(DtypeName(dtype)));
  }
  Status s = Check(nccl_->RedOpCreatePreMulSum(op, &scalar, NcclType(dtype), kNcclScalarHostImmediate, comm_),
                   "ncclRedOpCreatePreMulSum");
  *made = s.ok();
  return s;
}

Status NcclComm::Allreduce(const void* in, void* out, int64_t count, int32_t dtype, int32_t reduce_op,
                           double scale) {
  int op = 0;
  bool made = false;
  Status s = Reduction(dtype, reduce_op, scale, &op, &made);
  if (!s.ok()) return s;
  s = Check(nccl_->AllReduce(in, out, static_cast<size_t>(count), NcclType(dtype), op, comm_, device_->stream()),
            "ncclAllReduce");
  if (made) nccl_->RedOpDestroy(op, comm_);  // allowed once the call using it returned
  return s;
}

Status NcclComm::Broadcast(void* buf, int64_t bytes, int root) {
  return Check(nccl_->Broadcast(buf, buf, static_cast<size_t>(bytes), kNcclUint8, root, comm_, device_->stream()),
               "ncclBroadcast");
}

Status NcclComm::ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, int32_t dtype,
                               int32_t reduce_op, double scale) {
  int op = 0;
  bool made = false;
  Status s = Reduction(dtype, reduce_op, scale, &op, &made);
  if (!s.ok()) return s;
  // Counts may differ by a row (hvdlite splits rows unevenly): one reduce per rank's
  // block, rooted at that rank, in one group.
  const int elem = ElementSize(dtype);
  nccl_->GroupStart();
  int64_t at = 0;
  for (int k = 0; k < size_ && s.ok(); ++k) {
    s = Check(nccl_->Reduce(static_cast<const uint8_t*>(in) + at * elem, out, static_cast<size_t>(counts[k]),
                            NcclType(dtype), op, k, comm_, device_->stream()),
              "ncclReduce");
    at += counts[k];
  }
  Status g = Check(nccl_->GroupEnd(), "ncclGroupEnd");
  if (made) nccl_->RedOpDestroy(op, comm_);
  return s.ok() ? g : s;
}

Status NcclComm::Allgather(const void* in, void* out, const std::vector<int64_t>& bytes) {
  // Blocks may differ in size: a broadcast from each rank, grouped.
  Status s;
  nccl_->GroupStart();
  int64_t at = 0;
  for (int k = 0; k < size_ && s.ok(); ++k) {
    uint8_t* dst = static_cast<uint8_t*>(out) + at;
    s = Check(nccl_->Broadcast(k == rank_ ? in : dst, dst, static_cast<size_t>(bytes[k]), kNcclUint8, k, comm_,
                               device_->stream()),
              "ncclBroadcast");
    at += bytes[k];
  }
  Status g = Check(nccl_->GroupEnd(), "ncclGroupEnd");
  return s.ok() ? g : s;
}

Status NcclComm::Alltoall(const void* in, const std::vector<int64_t>& send, void* out,
                          const std::vector<int64_t>& recv) {
  Status s;
  nccl_->GroupStart();
  int64_t sent = 0, received = 0;
  for (int k = 0; k < size_ && s.ok(); ++k) {
    if (send[k] > 0) {
      s = Check(nccl_->Send(static_cast<const uint8_t*>(in) + sent, static_cast<size_t>(send[k]), kNcclUint8, k,
                            comm_, device_->stream()),
                "ncclSend");
    }
    if (s.ok() && recv[k] > 0) {
      s = Check(nccl_->Recv(static_cast<uint8_t*>(out) + received, static_cast<size_t>(recv[k]), kNcclUint8, k,
                            comm_, device_->stream()),
                "ncclRecv");
    }
    sent += send[k];
    received += recv[k];
  }
  Status g = Check(nccl_->GroupEnd(), "ncclGroupEnd");
  return s.ok() ? g : s;
}

}  // namespace gpu
}  // namespace hvdlite
