// The allreduce across hosts of different sizes (3 + 1 ranks, say), where the shards of
// HierarchicalAllreduce cannot line up across hosts:
//
//   1. the ranks of each host allreduce through shared memory (prescaled on the way in)
//      into one buffer each;
//   2. the hosts' leaders (local rank 0) allreduce it across hosts in a ring
//      (CrossLayer over the leaders), so each host's link carries 2 (h - 1) / h of the
//      buffer, as in the even case, only from one rank;
//   3. each leader sends the result within its host (GroupLayer, over MPI); every rank
//      copies it into its outputs, postscaled and divided on the way.
//
// The leader's result is every rank's, so every rank holds the same bits. Waits sleep
// (futex on the host, short sleeps between polls of MPI). Background thread only.
#pragma once

#include <cstdint>
#include <vector>

#include "algorithms/hierarchical_allreduce.h"

namespace hvdlite {

class LeaderAllreduce : public LayeredAllreduce {
 public:
  // host: the host's shared memory; leaders: the hosts' leaders (null on other ranks);
  // host_group: the host's ranks over MPI. Owned by the caller, outliving this object.
  LeaderAllreduce(HostLayer* host, CrossLayer* leaders, GroupLayer* host_group)
      : host_(host), leaders_(leaders), host_group_(host_group) {}

  Status Allreduce(const std::vector<ShmCollectives::Piece>& pieces, const AllreduceOptions& options,
                   const StepDone& step_done) override;

 private:
  HostLayer* host_;
  CrossLayer* leaders_;
  GroupLayer* host_group_;
  std::vector<uint8_t> sum_;  // the host's sum, then everyone's
};

}  // namespace hvdlite
