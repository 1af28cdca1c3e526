// The coordinator's decisions, free of any transport: rank 0 feeds it the requests
// gathered from every rank and it returns the responses every rank executes, in one
// order. It checks each tensor across ranks, tracks joined ranks, holds groups until
// they are complete, and reports stalls. The cycle's thread of rank 0 only.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/config.h"
#include "cycle/message.h"

namespace hvdlite {

class Controller {
 public:
  using Clock = std::chrono::steady_clock;

  // ranks: the global rank of each of the size ranks, for messages (empty: the ranks
  // are global ones); where: appended to every error, naming the process set.
  Controller(int size, const Config& config, std::vector<int> ranks = {}, std::string where = "")
      : size_(size), config_(config), ranks_(std::move(ranks)), where_(std::move(where)),
        joined_(size, 0) {}

  void AddRequest(const Request& request, Clock::time_point now);
  // Responses for every tensor that is now ready on all ranks, then errors for
  // stalled tensors past the stall shutdown time. Logs stall warnings.
  std::vector<Response> BuildResponses(Clock::time_point now);
  // True when a stall check is due although no rank sent anything.
  bool WantsRound(Clock::time_point now) const;
  size_t NumPending() const { return table_.size(); }

 private:
  struct PendingTensor {
    std::vector<Request> requests;  // indexed by rank
    std::vector<uint8_t> have;
    uint64_t seq = 0;
    Clock::time_point first_seen;
    Clock::time_point last_warning;
    bool warned = false;
  };
  bool Ready(const PendingTensor& p) const;
  Response Validate(const std::string& name, const PendingTensor& p) const;
  bool Mismatched(const std::string& name, const PendingTensor& p, const Request& base, Response* out) const;
  std::string MissingRanks(const PendingTensor& p) const;
  // "rank 3" / "ranks 0, 2" of set ranks, named by their global ranks.
  std::string Ranks(const std::vector<int>& set_ranks) const;
  // The global rank of a set rank.
  int Global(int r) const { return ranks_.empty() || r < 0 || r >= size_ ? r : ranks_[r]; }
  void CheckStalls(Clock::time_point now, std::vector<Response>* out);
  // A rank refused a tensor: the ranks that submitted it fail now, those that submit it
  // later fail as they do (AnswerRefused).
  void AddRefusal(const Request& refusal);
  bool AnswerRefused(const Request& request);
  Response RefusalError(const std::string& name, int32_t op, const std::string& error) const;

  int size_;
  Config config_;
  std::vector<int> ranks_;
  std::string where_;
  std::unordered_map<std::string, PendingTensor> table_;
  std::map<uint64_t, std::string> order_;  // arrival order -> name
  uint64_t seq_ = 0;
  std::vector<uint8_t> joined_;
  int joined_count_ = 0;
  int last_joined_ = -1;
  Clock::time_point last_stall_check_;
  struct Refused {
    std::string error;
    std::vector<uint8_t> owed;  // 1: the rank has not submitted it yet
  };
  std::unordered_map<std::string, Refused> refused_;
  std::vector<Response> refusal_errors_;  // sent with the next responses
};

}  // namespace hvdlite
