// The hierarchical broadcast: the root's data crosses each host's link once.
//
//   1. within the root's host, the root sends to every rank of it (its leader too);
//   2. the root's host's leader sends to the other hosts' leaders (at once with step 1
//      when the root is that leader);
//   3. within each other host, its leader sends to every rank of it.
//
// A flat broadcast of a large buffer scatters it and then allgathers it in a ring of
// ranks, which crosses a host's link several times when ranks alternate between hosts.
// The buffer goes through in chunks, pipelined so that a chunk is sent within the
// hosts while the next crosses the network (RunPipeline). Any number of ranks per host
// and any placement. Background thread only.
#pragma once

#include <cstdint>
#include <vector>

#include "transport/topology_layers.h"

namespace hvdlite {

class HierarchicalBroadcast {
 public:
  // As HierarchicalAllgather's.
  HierarchicalBroadcast(GroupLayer* host, GroupLayer* leaders, std::vector<std::vector<int>> hosts,
                        int rank);

  // buf's bytes from root to every rank, as MPI_Bcast.
  Status Bcast(void* buf, int64_t bytes, int root);

 private:
  GroupLayer* host_;
  GroupLayer* leaders_;
  std::vector<int> host_of_, local_rank_of_;  // per rank: its host, its place there
  int my_host_ = 0;
};

}  // namespace hvdlite
