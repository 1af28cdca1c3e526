// The hierarchical allgather: one exchange per host across hosts, by the hosts' leaders.
//
//   1. within each host, the host's leader (its lowest rank) gathers the host's parts
//      (its block);
//   2. the leaders allgather the hosts' blocks across hosts, so each host's link
//      carries its own block out and every other block in, once: the least an
//      allgather can move (a flat ring of ranks crosses each host boundary with almost
//      every part, several times over when ranks alternate between hosts);
//   3. each leader shares the whole result within its host.
//
// The steps go through in chunks (a slice of every host's block), pipelined so that a
// chunk is gathered and shared within the host while the next crosses the network
// (RunPipeline). Works for any number of ranks per host and any placement: the
// result is assembled in host order and, where the hosts' ranks are not consecutive,
// copied into rank order at the end. Background thread only.
#pragma once

#include <cstdint>
#include <vector>

#include "transport/topology_layers.h"

namespace hvdlite {

class HierarchicalAllgather {
 public:
  // hosts: the ranks of each host (LayerPlan::hosts); host: this rank's host over
  // MPI; leaders: the hosts' leaders, null on other ranks. The layers stay owned by
  // the caller and outlive this object.
  HierarchicalAllgather(GroupLayer* host, GroupLayer* leaders, std::vector<std::vector<int>> hosts,
                        int rank);

  // out = every rank's bytes_per_rank[k] bytes, in rank order, as MPI_Allgatherv; this
  // rank's come from in.
  Status Allgatherv(const void* in, int64_t in_bytes, void* out,
                    const std::vector<int64_t>& bytes_per_rank);

 private:
  GroupLayer* host_;
  GroupLayer* leaders_;
  const std::vector<std::vector<int>> hosts_;
  const int rank_;
  int my_host_ = 0;
  bool in_rank_order_ = true;  // host after host, the ranks run 0, 1, 2, ...
  std::vector<uint8_t> staging_;  // the result in host order, when that is not rank order
};

}  // namespace hvdlite
