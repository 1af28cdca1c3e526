#include "hierarchical_allreduce.h"

namespace hvdlite {

Status HierarchicalAllreduce::Allreduce(const std::vector<ShmAllreduce::Piece>& pieces,
                                        int32_t dtype, int32_t reduce_op, double prescale,
                                        double postscale, int64_t divisor,
                                        const StepDone& step_done) {
  int64_t count = 0;
  for (const ShmAllreduce::Piece& p : pieces) count += p.count;
  ShmAllreduce& shm = host_->shm();
  const int64_t lo = shm.ShardBegin(count, dtype, host_->rank());
  const int64_t n = shm.ShardBegin(count, dtype, host_->rank() + 1) - lo;
  shard_.resize(n * ElementSize(dtype));
  Status s = shm.ReduceScatter(pieces, dtype, reduce_op, prescale, shard_.data());
  step_done("SHM_REDUCESCATTER");
  if (!s.ok()) return s;
  s = cross_->Allreduce(shard_.data(), n, dtype, reduce_op);
  step_done("CROSS_HOST_ALLREDUCE");
  if (!s.ok()) return s;
  s = shm.Allgather(shard_.data(), pieces, dtype, postscale, divisor);
  step_done("SHM_ALLGATHER");
  return s;
}

}  // namespace hvdlite
