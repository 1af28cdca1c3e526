// Autotune (HVDLITE_AUTOTUNE=1, Horovod's HOROVOD_AUTOTUNE): the knobs of the cycle
// (fusion threshold, cycle time, shared-memory chunk size, hierarchical allreduce on or
// off where there are several hosts) tuned online from the measured throughput, bytes
// through collectives per second of wall time.
//
// Rank 0 measures: a sample is steps_per_sample cycles that moved data, lasting at
// least sample_seconds; the first warmup_samples at the starting values are thrown
// away, then each sample scores one trial of the search (KnobSearch), at most
// max_samples of them. One sample is noisy on a shared machine, so when the search's
// best is not the starting values, the two are measured again, alternately
// (kConfirmRounds each); the one with the higher mean score over all its samples stays.
//
// How every rank uses the same values: rank 0 alone decides, and its decision rides
// in the global set's coordination round, the bit vector every rank ANDs with every
// other in every cycle anyway (ProcessSetState::Coordinate). Rank 0 puts the knob
// values it wants there; the others put all ones; the AND hands every rank rank 0's
// values, in the same cycle, before that cycle executes anything. So fused buckets
// and shared-memory chunks match everywhere, and no extra collective is needed, nor a
// cycle count that would have to be lockstep: a separate exchange of scores at a
// chosen cycle would have to be placed where every rank is, which process sets make
// hard to prove, while the round of set 0 is already in every cycle of every rank.
// Ranks measure different times, so letting each decide for itself could not agree.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/config.h"
#include "cycle/tensor_queue.h"

namespace hvdlite {

// The values the cycle runs with; the same on every rank.
struct TunedKnobs {
  int64_t fusion_threshold = 0;  // bytes
  double cycle_time_ms = 0;
  int64_t shm_chunk_bytes = 0;   // <= ShmCollectives::kChunkBytes
  bool hierarchical = true;      // use the hierarchical allreduce where it was built
  bool operator==(const TunedKnobs& o) const {
    return fusion_threshold == o.fusion_threshold && cycle_time_ms == o.cycle_time_ms &&
           shm_chunk_bytes == o.shm_chunk_bytes && hierarchical == o.hierarchical;
  }
  bool operator!=(const TunedKnobs& o) const { return !(*this == o); }
};

// The search alone, without clocks or MPI: coordinate descent over a small grid per
// knob. Starts at the given values (so they are always a trial), then, knob by knob,
// tries each other grid value with the rest at the best found so far, and moves to the
// better one; passes repeat while a pass changed something and trials remain. Each
// configuration is tried once. The best is always the highest-scoring trial.
class KnobSearch {
 public:
  // shared_memory: whether allreduces go through ShmCollectives (else its chunk stays);
  // hierarchy: whether the hierarchical allreduce exists to be switched off.
  KnobSearch(const TunedKnobs& start, const AutotuneSettings& settings, bool shared_memory,
             bool hierarchy, int64_t max_chunk_bytes);
  bool done() const { return done_; }
  // The values to measure next (the best, once done).
  const TunedKnobs& candidate() const { return done_ ? best_ : candidate_; }
  // The score of candidate(); moves on to the next.
  void Record(double score);
  const TunedKnobs& best() const { return best_; }
  double best_score() const { return best_score_; }
  int64_t trials() const { return static_cast<int64_t>(tried_.size()); }

 private:
  struct Dimension {
    std::vector<double> values;
  };
  static double Get(const TunedKnobs& k, size_t dim);
  static void Set(TunedKnobs* k, size_t dim, double v);
  // Advances to the next untried configuration; done_ when none or out of trials.
  void Next();

  std::vector<Dimension> dims_;  // by knob: fusion, cycle, chunk, hierarchical
  int64_t max_trials_;
  std::vector<TunedKnobs> tried_;
  TunedKnobs candidate_, best_;
  double best_score_ = -1;
  size_t dim_ = 0, value_ = 0;  // where the walk is
  bool changed_in_pass_ = false;
  bool done_ = false;
};

// Public view of the tuner (hvdlite_autotune_state).
struct AutotuneView {
  bool enabled = false, settled = false;
  int64_t trials = 0;
  TunedKnobs knobs;
};

// The tuner's state, owned by Core. The background thread calls everything but View.
class Autotuner {
 public:
  // At init, before the loop. Rank 0 opens the log here; an error names the file.
  // shared_memory, hierarchy: how the global set allreduces (one host through shared
  // memory; several hosts hierarchically).
  Status Start(const AutotuneSettings& settings, const Config& config, int rank, bool shared_memory,
               bool hierarchy);
  void Stop();  // closes the log
  bool enabled() const { return settings_.enabled; }
  // The values in force this cycle.
  const TunedKnobs& knobs() const { return knobs_; }

  // The global set's coordination round: words to append to its bit vector (0 when
  // off), filled with what rank 0 wants (all ones elsewhere), then, after the AND,
  // adopted by every rank.
  static constexpr size_t kWords = 4;
  size_t Words() const { return settings_.enabled ? kWords : 0; }
  void Publish(uint64_t* words) const;
  void Adopt(const uint64_t* words, Clock::time_point now);

  // End of each cycle with the bytes its collectives moved; rank 0 measures.
  void EndCycle(Clock::time_point now, int64_t bytes);

  AutotuneView View() const;  // any thread

 private:
  void Log(const char* what, const TunedKnobs& k, double score);
  // Rank 0: the values to run next.
  const TunedKnobs& Wanted() const;
  // Rank 0: a sample of knobs_ ended with this score.
  void Sampled(double score);
  // Rank 0, once the search ended: the starting values against its best, or the choice.
  void Confirm();
  void Settle(const TunedKnobs& chosen, double score);
  static constexpr int kConfirmRounds = 2;

  AutotuneSettings settings_;
  int rank_ = 0;
  TunedKnobs knobs_;        // in force on every rank
  int64_t trials_seen_ = 0; // trials rank 0 finished, as published
  bool settled_seen_ = false;
  // Rank 0 only.
  std::unique_ptr<KnobSearch> search_;
  int64_t warmups_left_ = 0;
  Clock::time_point window_start_;
  int64_t window_bytes_ = 0, window_steps_ = 0;
  TunedKnobs start_;                      // the first trial
  double start_score_ = 0;
  std::vector<TunedKnobs> confirming_;    // the samples still to take, in order
  double sums_[2] = {0, 0};               // scores of start_ and the search's best
  int counts_[2] = {0, 0};
  bool settled_ = false;
  TunedKnobs chosen_;
  FILE* log_ = nullptr;

  mutable std::mutex view_mutex_;
  AutotuneView view_;  // Guarded by view_mutex_.
};

}  // namespace hvdlite
