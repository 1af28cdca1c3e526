#include "algorithms/hierarchical_broadcast.h"

#include <algorithm>

namespace hvdlite {

HierarchicalBroadcast::HierarchicalBroadcast(GroupLayer* host, GroupLayer* leaders,
                                             std::vector<std::vector<int>> hosts, int rank)
    : host_(host), leaders_(leaders) {
  int size = 0;
  for (const std::vector<int>& h : hosts) size += static_cast<int>(h.size());
  host_of_.resize(size);
  local_rank_of_.resize(size);
  for (size_t j = 0; j < hosts.size(); ++j) {
    for (size_t l = 0; l < hosts[j].size(); ++l) {
      host_of_[hosts[j][l]] = static_cast<int>(j);
      local_rank_of_[hosts[j][l]] = static_cast<int>(l);
    }
  }
  my_host_ = host_of_[rank];
}

Status HierarchicalBroadcast::Bcast(void* buf, int64_t bytes, int root) {
  if (bytes == 0) return Status::OK();
  uint8_t* data = static_cast<uint8_t*>(buf);
  const int64_t chunks = PipelineChunks(bytes);
  auto chunk_at = [&](int64_t c) { return bytes * c / chunks; };
  auto chunk_bytes = [&](int64_t c) { return chunk_at(c + 1) - chunk_at(c); };
  const bool roots_host = my_host_ == host_of_[root];
  const bool shares = host_->size() > 1;
  // The root sends within its host at once when it is the leader (with stage 2), else
  // first, so that the leader has the chunk.
  const bool root_leads = local_rank_of_[root] == 0;
  auto from_root = [&](int64_t c, Pending* p) {
    if (!roots_host || !shares) return Status::OK();
    return host_->Bcast(data + chunk_at(c), chunk_bytes(c), local_rank_of_[root], p);
  };
  const PipelineStage to_leader = [&](int64_t c, Pending* p) {
    return root_leads ? Status::OK() : from_root(c, p);
  };
  const PipelineStage across_hosts = [&](int64_t c, Pending* p) {
    Status st = root_leads ? from_root(c, p) : Status::OK();
    if (!st.ok() || !leaders_) return st;
    return leaders_->Bcast(data + chunk_at(c), chunk_bytes(c), host_of_[root], p);
  };
  const PipelineStage within_host = [&](int64_t c, Pending* p) {
    if (roots_host || !shares) return Status::OK();
    return host_->Bcast(data + chunk_at(c), chunk_bytes(c), 0, p);
  };
  return RunPipeline(chunks, {to_leader, across_hosts, within_host});
}

}  // namespace hvdlite
