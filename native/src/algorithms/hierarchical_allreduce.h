// The hierarchical allreduce: the plan of steps over the topology layers.
//
//   1. reduce-scatter within the host through shared memory: local rank l ends with
//      shard l of the buffer reduced over its host (prescaled on the way in);
//   2. each local rank allreduces its shard across hosts with the ranks of the same
//      local rank (CrossLayer): the L local ranks of a host do so at once, each with
//      1/L of the buffer, so a host's link carries 2 (h - 1) / h of the buffer in all,
//      the least any allreduce over h hosts can send;
//   3. allgather within the host through shared memory: every rank copies every shard
//      into its outputs (postscaled and divided, for Average, on the way out).
//
// The buffer goes through in blocks (kBlockBytes), pipelined so that the network step
// of one block overlaps the host steps of its neighbours: while block k crosses the
// network, the host reduce-scatters block k + 1, whose ring then starts beside block
// k's (CrossLayer's two slots: the link stays busy between one ring's steps), and
// allgathers block k once its ring is done (the rings move on between the host's
// rounds and while its barriers wait).
//
// Every element is reduced in the same order wherever it is reduced and then copied,
// so every rank holds the same bits. Needs the same number of ranks on every host
// (PlanLayers decides). Background thread only.
#pragma once

#include <functional>
#include <vector>

#include "transport/topology_layers.h"

namespace hvdlite {

// An allreduce over the topology layers, by the plan of steps PlanLayers chose: this
// one (hosts of equal size) or LeaderAllreduce (leader_allreduce.h, uneven hosts).
class LayeredAllreduce {
 public:
  virtual ~LayeredAllreduce() = default;
  // Called after each step with its timeline activity name.
  using StepDone = std::function<void(const char* activity)>;
  // The pieces' outs = reduce over every rank of the pieces' ins, as options say (as
  // ShmCollectives::Allreduce). Every rank calls it with the same counts and options, in
  // the same order.
  virtual Status Allreduce(const std::vector<ShmCollectives::Piece>& pieces,
                           const AllreduceOptions& options, const StepDone& step_done) = 0;
};

class HierarchicalAllreduce : public LayeredAllreduce {
 public:
  // The layers stay owned by the caller and outlive this object.
  HierarchicalAllreduce(HostLayer* host, CrossLayer* cross) : host_(host), cross_(cross) {}

  Status Allreduce(const std::vector<ShmCollectives::Piece>& pieces, const AllreduceOptions& options,
                   const StepDone& step_done) override;

 private:
  // Bytes of the buffer per block of the pipeline: at most kBlockBytes, whose shards are
  // large enough for the network to run at full rate, and smaller for a smaller buffer,
  // so that it too has kMinBlocks blocks to overlap, down to kMinBlockBytes.
  static constexpr int64_t kBlockBytes = 2 << 20;
  static constexpr int64_t kMinBlockBytes = 512 << 10;
  static constexpr int64_t kMinBlocks = 8;

  HostLayer* host_;
  CrossLayer* cross_;
  std::vector<uint8_t> shards_[2];  // this rank's shard of blocks k and k + 1
};

}  // namespace hvdlite
