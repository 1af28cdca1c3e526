#include "algorithms/hierarchical_allgather.h"

#include <algorithm>
#include <cstring>

namespace hvdlite {

HierarchicalAllgather::HierarchicalAllgather(GroupLayer* host, GroupLayer* leaders,
                                             std::vector<std::vector<int>> hosts, int rank)
    : host_(host), leaders_(leaders), hosts_(std::move(hosts)), rank_(rank) {
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
  // Chunk c: slice c of every host's block.
  const int64_t chunks = PipelineChunks(total);
  auto slice_at = [&](int j, int64_t c) { return block_at[j] + block[j] * c / chunks; };
  auto slice_bytes = [&](int j, int64_t c) { return slice_at(j, c + 1) - slice_at(j, c); };
  // 1. Within the host, the parts of slice c to the leader: of each rank's part, what
  // lies in the slice (a range of its part, maybe empty).
  const std::vector<int>& mine = hosts_[my_host_];
  const PipelineStage to_leader = [&](int64_t c, Pending* p) {
    const int64_t lo = slice_at(my_host_, c), hi = lo + slice_bytes(my_host_, c);
    std::vector<int64_t> part_bytes, part_at;
    const void* send = nullptr;
    int64_t send_bytes = 0;
    for (int r : mine) {
      const int64_t from = std::max(lo, at[r]), to = std::min(hi, at[r] + bytes_per_rank[r]);
      part_bytes.push_back(std::max<int64_t>(0, to - from));
      part_at.push_back(from);
      if (r == rank_ && to > from) {
        send = static_cast<const uint8_t*>(in) + (from - at[r]);
        send_bytes = to - from;
      }
    }
    return host_->Gatherv(send, send_bytes, result, part_bytes, part_at, p);
  };
  // 2. The leaders exchange the hosts' slices c.
  const PipelineStage across_hosts = [&](int64_t c, Pending* p) {
    if (!leaders_) return Status::OK();
    std::vector<int64_t> bytes(hosts), displs(hosts);
    for (int j = 0; j < hosts; ++j) {
      bytes[j] = slice_bytes(j, c);
      displs[j] = slice_at(j, c);
    }
    return leaders_->Allgatherv(result, bytes, displs, p);
  };
  // 3. Each leader sends every host's slice c within its host.
  const PipelineStage within_host = [&](int64_t c, Pending* p) {
    if (host_->size() == 1) return Status::OK();
    Status st;
    for (int j = 0; j < hosts && st.ok(); ++j) {
      if (slice_bytes(j, c) > 0) st = host_->Bcast(result + slice_at(j, c), slice_bytes(j, c), 0, p);
    }
    return st;
  };
  Status s = RunPipeline(chunks, {to_leader, across_hosts, within_host});
  if (!s.ok() || in_rank_order_) return s;
  int64_t to = 0;
  for (size_t r = 0; r < bytes_per_rank.size(); ++r) {
    if (bytes_per_rank[r] > 0) std::memcpy(static_cast<uint8_t*>(out) + to, result + at[r], bytes_per_rank[r]);
    to += bytes_per_rank[r];
  }
  return s;
}

}  // namespace hvdlite
