#include "algorithms/leader_allreduce.h"

#include <cstring>

#include "common/elementwise.h"

namespace hvdlite {

Status LeaderAllreduce::Allreduce(const std::vector<ShmCollectives::Piece>& pieces,
                                  const AllreduceOptions& options, const StepDone& step_done) {
  const int32_t dtype = options.dtype;
  const int64_t elem = ElementSize(dtype);
  int64_t count = 0;
  for (const ShmCollectives::Piece& p : pieces) count += p.count;
  sum_.resize(count * elem);
  // 1. The host's sum, of every piece, into one buffer (a host of one rank: a copy).
  std::vector<ShmCollectives::Piece> into_sum;
  int64_t at = 0;
  for (const ShmCollectives::Piece& p : pieces) {
    into_sum.push_back({p.in, sum_.data() + at * elem, p.count});
    if (host_->size() == 1) {
      if (p.in) {
        ScaledCopy(sum_.data() + at * elem, p.in, p.count, dtype, options.prescale, 1);
      } else {
        std::memset(sum_.data() + at * elem, 0, p.count * elem);  // joined: zeros
      }
    }
    at += p.count;
  }
  Status s;
  // Scaled on the way in only: the result is scaled on its way out of sum_ (step 3).
  AllreduceOptions in_only = options;
  in_only.postscale = 1.0;
  in_only.divisor = 1;
  if (host_->size() > 1) s = host_->shm().Allreduce(into_sum, in_only);
  step_done("SHM_ALLREDUCE");
  // 2. Across hosts, by the leaders.
  if (s.ok() && leaders_) s = leaders_->Allreduce(sum_.data(), count, dtype, options.reduce_op);
  step_done("CROSS_HOST_ALLREDUCE");
  // 3. From the leader to its host.
  if (s.ok() && host_group_->size() > 1) {
    s = RunPipeline(1, {[&](int64_t, Pending* p) {
      return host_group_->Bcast(sum_.data(), count * elem, 0, p);
    }});
  }
  at = 0;
  for (const ShmCollectives::Piece& p : pieces) {
    if (s.ok() && p.out) ScaledCopy(p.out, sum_.data() + at * elem, p.count, dtype, options.postscale, options.divisor);
    at += p.count;
  }
  step_done("HOST_BROADCAST");
  return s;
}

}  // namespace hvdlite
