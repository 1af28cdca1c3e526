#include "cycle/autotune.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "transport/shm_collectives.h"

namespace hvdlite {
namespace {

constexpr int64_t kMiB = 1 << 20;
enum Knob : size_t { kFusion, kCycle, kChunk, kHierarchical, kKnobs };

// The grid of one knob: `grid`, plus the starting value (always a trial), sorted.
std::vector<double> Grid(std::vector<double> grid, double start, bool fixed) {
  if (fixed) return {start};
  grid.push_back(start);
  std::sort(grid.begin(), grid.end());
  grid.erase(std::unique(grid.begin(), grid.end()), grid.end());
  return grid;
}

// The flags word of the published knobs: bit 0 hierarchical, bit 1 settled, the
// trials finished above.
constexpr uint64_t kHierarchicalBit = 1, kSettledBit = 2;
constexpr int kTrialsShift = 8;

}  // namespace

// ------------------------------------------------------------------ KnobSearch

KnobSearch::KnobSearch(const TunedKnobs& start, const AutotuneSettings& settings, bool shared_memory,
                       bool hierarchy, int64_t max_chunk_bytes)
    : dims_(kKnobs), max_trials_(settings.max_samples), candidate_(start), best_(start) {
  // Fusion: tensors of 1 MiB and more are reduced alone anyway, so the threshold
  // matters between that and the default 128 MiB. Cycle time: how long a burst of
  // requests may gather. Chunk: the shared-memory pipeline's grain, up to the slots.
  dims_[kFusion].values = Grid({1.0 * kMiB, 4.0 * kMiB, 16.0 * kMiB, 64.0 * kMiB, 128.0 * kMiB},
                               static_cast<double>(start.fusion_threshold), settings.fixed_fusion_threshold);
  dims_[kCycle].values = Grid({0.5, 1, 2, 5}, start.cycle_time_ms, settings.fixed_cycle_time);
  std::vector<double> chunks;
  for (int64_t c = max_chunk_bytes; c >= max_chunk_bytes / 8 && c >= 4096; c /= 2) chunks.push_back(static_cast<double>(c));
  dims_[kChunk].values = Grid(chunks, static_cast<double>(start.shm_chunk_bytes), !shared_memory);
  dims_[kHierarchical].values = Grid({0, 1}, start.hierarchical ? 1 : 0, !hierarchy || settings.fixed_hierarchical);
  done_ = max_trials_ <= 0;
}

double KnobSearch::Get(const TunedKnobs& k, size_t dim) {
  switch (dim) {
    case kFusion: return static_cast<double>(k.fusion_threshold);
    case kCycle: return k.cycle_time_ms;
    case kChunk: return static_cast<double>(k.shm_chunk_bytes);
    default: return k.hierarchical ? 1 : 0;
  }
}

void KnobSearch::Set(TunedKnobs* k, size_t dim, double v) {
  switch (dim) {
    case kFusion: k->fusion_threshold = static_cast<int64_t>(v); break;
    case kCycle: k->cycle_time_ms = v; break;
    case kChunk: k->shm_chunk_bytes = static_cast<int64_t>(v); break;
    default: k->hierarchical = v != 0; break;
  }
}

void KnobSearch::Record(double score) {
  if (done_) return;
  tried_.push_back(candidate_);
  if (score > best_score_) {
    if (tried_.size() > 1) changed_in_pass_ = true;
    best_ = candidate_;
    best_score_ = score;
  }
  Next();
}

void KnobSearch::Next() {
  while (static_cast<int64_t>(tried_.size()) < max_trials_) {
    if (value_ >= dims_[dim_].values.size()) {
      value_ = 0;
      if (++dim_ == dims_.size()) {
        // End of a pass: another only if this one moved the best (its knobs' best
        // values may depend on the new neighbours).
        if (!changed_in_pass_) break;
        dim_ = 0;
        changed_in_pass_ = false;
      }
      continue;
    }
    TunedKnobs k = best_;
    Set(&k, dim_, dims_[dim_].values[value_++]);
    if (std::find(tried_.begin(), tried_.end(), k) == tried_.end()) {
      candidate_ = k;
      return;
    }
  }
  done_ = true;
}

// ------------------------------------------------------------------- Autotuner

Status Autotuner::Start(const AutotuneSettings& settings, const Config& config, int rank, bool shared_memory,
                        bool hierarchy) {
  Stop();
  settings_ = settings;
  rank_ = rank;
  knobs_ = TunedKnobs();
  knobs_.fusion_threshold = config.fusion_threshold;
  knobs_.cycle_time_ms = config.cycle_time_ms;
  knobs_.shm_chunk_bytes = ShmCollectives::kChunkBytes;
  knobs_.hierarchical = true;
  trials_seen_ = 0;
  settled_seen_ = false;
  search_.reset();
  confirming_.clear();
  settled_ = false;
  start_ = chosen_ = knobs_;
  window_bytes_ = window_steps_ = 0;
  window_start_ = Clock::now();
  if (settings_.enabled && rank_ == 0) {
    search_.reset(new KnobSearch(knobs_, settings_, shared_memory, hierarchy, ShmCollectives::kChunkBytes));
    warmups_left_ = settings_.warmup_samples;
    if (!settings_.log_path.empty()) {
      log_ = std::fopen(settings_.log_path.c_str(), "w");
      if (!log_) {
        return InvalidArgument("HVDLITE_AUTOTUNE_LOG='" + settings_.log_path +
                               "' cannot be opened for writing: " + std::strerror(errno));
      }
      std::fprintf(log_, "trial,fusion_threshold_bytes,cycle_time_ms,shm_chunk_bytes,hierarchical,score_bytes_per_s\n");
      std::fflush(log_);
    }
  }
  std::lock_guard<std::mutex> lock(view_mutex_);
  view_.enabled = settings_.enabled;
  view_.settled = false;
  view_.trials = 0;
  view_.knobs = knobs_;
  return Status::OK();
}

void Autotuner::Stop() {
  if (log_) std::fclose(log_);
  log_ = nullptr;
}

void Autotuner::Log(const char* what, const TunedKnobs& k, double score) {
  if (!log_) return;
  std::fprintf(log_, "%s,%lld,%g,%lld,%d,%.6g\n", what, static_cast<long long>(k.fusion_threshold),
               k.cycle_time_ms, static_cast<long long>(k.shm_chunk_bytes), k.hierarchical ? 1 : 0, score);
  std::fflush(log_);
}

void Autotuner::Publish(uint64_t* words) const {
  if (!search_) {  // not rank 0: all ones leave rank 0's words as they are in the AND
    std::fill(words, words + kWords, ~0ull);
    return;
  }
  const TunedKnobs& k = Wanted();
  words[0] = static_cast<uint64_t>(k.fusion_threshold);
  std::memcpy(&words[1], &k.cycle_time_ms, sizeof(double));
  words[2] = static_cast<uint64_t>(k.shm_chunk_bytes);
  words[3] = (k.hierarchical ? kHierarchicalBit : 0) | (settled_ ? kSettledBit : 0) |
             (static_cast<uint64_t>(search_->trials()) << kTrialsShift);
}

void Autotuner::Adopt(const uint64_t* words, Clock::time_point now) {
  TunedKnobs k;
  k.fusion_threshold = static_cast<int64_t>(words[0]);
  std::memcpy(&k.cycle_time_ms, &words[1], sizeof(double));
  k.shm_chunk_bytes = static_cast<int64_t>(words[2]);
  k.hierarchical = words[3] & kHierarchicalBit;
  const bool settled = words[3] & kSettledBit;
  const int64_t trials = static_cast<int64_t>(words[3] >> kTrialsShift);
  if (k != knobs_) {
    // A new trial starts now, on every rank: rank 0 measures it from here.
    knobs_ = k;
    window_start_ = now;
    window_bytes_ = window_steps_ = 0;
  }
  if (trials == trials_seen_ && settled == settled_seen_ && view_.knobs == k) return;
  trials_seen_ = trials;
  settled_seen_ = settled;
  std::lock_guard<std::mutex> lock(view_mutex_);
  view_.settled = settled;
  view_.trials = trials;
  view_.knobs = k;
}

void Autotuner::EndCycle(Clock::time_point now, int64_t bytes) {
  if (!search_ || settled_ || bytes <= 0) return;
  window_bytes_ += bytes;
  const double seconds = std::chrono::duration<double>(now - window_start_).count();
  if (++window_steps_ < settings_.steps_per_sample || seconds < settings_.sample_seconds) return;
  const double score = seconds > 0 ? window_bytes_ / seconds : 0;
  window_start_ = now;
  window_bytes_ = window_steps_ = 0;
  Sampled(score);
}

const TunedKnobs& Autotuner::Wanted() const {
  if (settled_) return chosen_;
  if (!confirming_.empty()) return confirming_.front();
  return search_->candidate();
}

void Autotuner::Sampled(double score) {
  if (warmups_left_ > 0) {
    --warmups_left_;
    Log("warmup", knobs_, score);
    return;
  }
  if (!search_->done()) {
    if (search_->trials() == 0) start_score_ = score;
    Log(std::to_string(search_->trials()).c_str(), knobs_, score);
    search_->Record(score);
    if (search_->done()) Confirm();
    return;
  }
  // A confirmation sample: knobs_ is the front of confirming_ (Adopt restarted the
  // window when it came into force).
  Log("confirm", knobs_, score);
  const int which = knobs_ == start_ ? 0 : 1;
  sums_[which] += score;
  ++counts_[which];
  confirming_.erase(confirming_.begin());
  if (confirming_.empty()) {
    const double start_mean = sums_[0] / counts_[0], best_mean = sums_[1] / counts_[1];
    if (best_mean > start_mean) {
      Settle(search_->best(), best_mean);
    } else {
      Settle(start_, start_mean);
    }
  }
}

void Autotuner::Confirm() {
  if (search_->best() == start_) {
    Settle(start_, search_->best_score());
    return;
  }
  sums_[0] = start_score_;
  sums_[1] = search_->best_score();
  counts_[0] = counts_[1] = 1;
  for (int i = 0; i < kConfirmRounds; ++i) {
    confirming_.push_back(start_);
    confirming_.push_back(search_->best());
  }
}

void Autotuner::Settle(const TunedKnobs& chosen, double score) {
  settled_ = true;
  chosen_ = chosen;
  Log("chosen", chosen, score);
  HVDLITE_LOG(INFO) << "autotune chose fusion threshold " << chosen.fusion_threshold << " bytes, cycle time "
                    << chosen.cycle_time_ms << " ms, chunk " << chosen.shm_chunk_bytes << " bytes after "
                    << search_->trials() << " trials";
}

AutotuneView Autotuner::View() const {
  std::lock_guard<std::mutex> lock(view_mutex_);
  return view_;
}

}  // namespace hvdlite
