#include "algorithms/hierarchical_allreduce.h"

#include <algorithm>

namespace hvdlite {
namespace {

// Lets the host's barriers move the cross-host ring on for as long as it lives.
class ProgressWhileWaiting {
 public:
  ProgressWhileWaiting(ShmCollectives& shm, CrossLayer& cross) : shm_(shm) {
    shm_.SetIdle([&cross] { return cross.Progress(); });
  }
  ~ProgressWhileWaiting() { shm_.SetIdle(nullptr); }

 private:
  ShmCollectives& shm_;
};

}  // namespace

Status HierarchicalAllreduce::Allreduce(const std::vector<ShmCollectives::Piece>& pieces,
                                        const AllreduceOptions& options, const StepDone& step_done) {
  const int32_t dtype = options.dtype, reduce_op = options.reduce_op;
  const double prescale = options.prescale, postscale = options.postscale;
  const int64_t divisor = options.divisor;
  const int64_t elem = ElementSize(dtype);
  int64_t count = 0;
  for (const ShmCollectives::Piece& p : pieces) count += p.count;
  // At least kMinBlocks blocks where that keeps them kMinBlockBytes or more.
  const int64_t block = std::max<int64_t>(
      1, std::min(kBlockBytes, std::max(kMinBlockBytes, count * elem / kMinBlocks)) / elem);
  const int64_t blocks = (count + block - 1) / block;
  ShmCollectives& shm = host_->shm();
  const int me = host_->rank();
  // Block k: flat elements [k * block, k * block + length(k)), cut into even shards
  // (bounds(k)); this rank's shard of it.
  auto length = [&](int64_t k) { return std::min(block, count - k * block); };
  auto bounds = [&](int64_t k) { return shm.EvenShards(length(k), dtype); };
  auto shard_length = [&](int64_t k) {
    const std::vector<int64_t> b = bounds(k);
    return b[me + 1] - b[me];
  };
  auto shard = [&](int64_t k) {
    std::vector<uint8_t>& s = shards_[k % 2];
    s.resize(shard_length(k) * elem);
    return s.data();
  };
  ProgressWhileWaiting progress(shm, *cross_);
  Status s;
  if (blocks > 0) s = shm.ReduceScatter(pieces, 0, bounds(0), dtype, reduce_op, prescale, shard(0));
  if (s.ok() && blocks > 0) s = cross_->Start(0, shards_[0].data(), shard_length(0), dtype, reduce_op);
  step_done("SHM_REDUCESCATTER");
  for (int64_t k = 0; k < blocks && s.ok(); ++k) {
    const int slot = static_cast<int>(k % 2), next = 1 - slot;
    if (k + 1 < blocks) {
      // Block k + 1 joins block k on the network (the other slot, whose last user,
      // block k - 1, is done and copied out).
      s = shm.ReduceScatter(pieces, (k + 1) * block, bounds(k + 1), dtype, reduce_op, prescale,
                            shard(k + 1));
      if (s.ok()) s = cross_->Start(next, shards_[next].data(), shard_length(k + 1), dtype, reduce_op);
      step_done("SHM_REDUCESCATTER");
    }
    if (s.ok()) s = cross_->Wait(slot);
    step_done("CROSS_HOST_ALLREDUCE");
    if (s.ok()) {
      s = shm.Allgather(shards_[slot].data(), pieces, k * block, bounds(k), dtype, postscale, divisor);
    }
    step_done("SHM_ALLGATHER");
  }
  return s;
}

}  // namespace hvdlite
