// One process set's NCCL communicator and the collectives the core runs on it, on the
// core's stream (gpu::Device). Background thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/common.h"
#include "gpu/cuda_api.h"
#include "gpu/device.h"

namespace hvdlite {
namespace gpu {

// NCCL's type for an hvdlite dtype; -1 where NCCL has none (bool, int16, uint16).
int NcclType(int32_t dtype);
// NCCL's reduction for Sum, Min, Max, Product; -1 otherwise (Average is a scaled Sum).
int NcclReduction(int32_t reduce_op);

class NcclComm {
 public:
  // Collective over the set: rank 0 makes the unique id, `broadcast` hands its 128 bytes
  // to the others (over MPI), every member joins.
  Status Init(const NcclApi* nccl, Device* device, int rank, int size,
              const std::function<Status(void*, int64_t)>& broadcast);
  bool ready() const { return comm_ != nullptr; }
  void Destroy();

  // Sum of the inputs times `scale` (1: a plain reduction of reduce_op), in place or not.
  Status Allreduce(const void* in, void* out, int64_t count, int32_t dtype, int32_t reduce_op, double scale);
  Status Broadcast(void* buf, int64_t bytes, int root);
  // Rank k's rows of the reduction of `in` into `out`: counts[k] elements each, back to back.
  Status ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, int32_t dtype,
                       int32_t reduce_op, double scale);
  // Every rank's block, rank order: bytes[k] from rank k, packed into `out`.
  Status Allgather(const void* in, void* out, const std::vector<int64_t>& bytes);
  // send[k] bytes to rank k from `in` (packed), recv[k] bytes from rank k into `out`.
  Status Alltoall(const void* in, const std::vector<int64_t>& send, void* out, const std::vector<int64_t>& recv);

 private:
  Status Check(int code, const char* what) const;
  // The reduction to pass: reduce_op's own, or a pre-multiplied sum made for `scale`.
  Status Reduction(int32_t dtype, int32_t reduce_op, double scale, int* op, bool* made);

  const NcclApi* nccl_ = nullptr;
  Device* device_ = nullptr;
  NcclCommHandle comm_ = nullptr;
  int rank_ = 0, size_ = 0;
};

}  // namespace gpu
}  // namespace hvdlite
