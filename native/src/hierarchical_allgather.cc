#include "hierarchical_allgather.h"

#include <algorithm>
#include <cstring>

namespace hvdlite {

HierarchicalAllgather::HierarchicalAllgather(GroupLayer* host, GroupLayer* leaders,
                                             std::vector<std::vector<int>> hosts, int rank)
    : host_(host), leaders_(leaders), hosts_(std::move(hosts)) {
  int next = 0;
  for (size_t j = 0; j < hosts_.size(); ++j) {
    for (int r : hosts_[j]) {
      if (r == rank) my_host_ = static_cast<int>(j);
      in_rank_order_ = in_rank_order_ && r == next++;
    }
  }
}

Status HierarchicalAllgather::Allgatherv(const void* in, int64_t in_bytes, void* out,
                                         const std::vector<int64_t>& bytes_per_rank) {
  const int hosts = static_cast<int>(hosts_.size());
  // Where each rank's part lies in the result in host order, and each host's block.
  std::vector<int64_t> at(bytes_per_rank.size()), block_at(hosts), block(hosts, 0);
  int64_t total = 0;
  for (int j = 0; j < hosts; ++j) {
    block_at[j] = total;
    for (int r : hosts_[j]) {
      at[r] = total;
      total += bytes_per_rank[r];
    }
    block[j] = total - block_at[j];
  }
  uint8_t* result = static_cast<uint8_t*>(out);
  if (!in_rank_order_) {
    staging_.resize(total);
    result = staging_.data();
  }
  // 1. The host's parts to its leader.
  const std::vector<int>& mine = hosts_[my_host_];
  std::vector<int64_t> part_bytes, part_at;
  for (int r : mine) {
    part_bytes.push_back(bytes_per_rank[r]);
    part_at.push_back(at[r]);
  }
  Status s = RunPipeline(1, {[&](int64_t, Pending* p) {
    return host_->Gatherv(in, in_bytes, result, part_bytes, part_at, p);
  }});
  if (!s.ok()) return s;
  // 2 and 3, chunk c being slice c of every host's block.
  const int64_t chunks = std::max<int64_t>(1, std::min(kMaxChunks, total / kChunkBytes));
  auto slice_at = [&](int j, int64_t c) { return block_at[j] + block[j] * c / chunks; };
  auto slice_bytes = [&](int j, int64_t c) { return slice_at(j, c + 1) - slice_at(j, c); };
  const PipelineStage across_hosts = [&](int64_t c, Pending* p) {
    if (!leaders_) return Status::OK();
    std::vector<int64_t> bytes(hosts), displs(hosts);
    for (int j = 0; j < hosts; ++j) {
      bytes[j] = slice_bytes(j, c);
      displs[j] = slice_at(j, c);
    }
    return leaders_->Allgatherv(result, bytes, displs, p);
  };
  const PipelineStage within_host = [&](int64_t c, Pending* p) {
    if (host_->size() == 1) return Status::OK();
    Status st;
    for (int j = 0; j < hosts && st.ok(); ++j) {
      if (slice_bytes(j, c) > 0) st = host_->Bcast(result + slice_at(j, c), slice_bytes(j, c), 0, p);
    }
    return st;
  };
  s = RunPipeline(chunks, {across_hosts, within_host});
  if (!s.ok() || in_rank_order_) return s;
  int64_t to = 0;
  for (size_t r = 0; r < bytes_per_rank.size(); ++r) {
    if (bytes_per_rank[r] > 0) std::memcpy(static_cast<uint8_t*>(out) + to, result + at[r], bytes_per_rank[r]);
    to += bytes_per_rank[r];
  }
  return s;
}

}  // namespace hvdlite
