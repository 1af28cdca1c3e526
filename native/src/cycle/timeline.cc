// About 600 lines in one file: the intern table, the producer and the writer below share the ring's
// record layout, private to this file; each part starts at a "// ---- " header.
#include "cycle/timeline.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>

#ifdef __linux__
#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hvdlite {
namespace {

// The writer wakes this often (or when the ring is half full), writes the batch and
// flushes it, so a crash loses at most this much of the end of the trace.
constexpr auto kWriterPeriod = std::chrono::milliseconds(100);
// The writer formats into a buffer this large and writes it whenever it fills: small
// enough to stay in cache, large enough that the write calls cost nothing.
constexpr size_t kOutBytes = size_t{1} << 17;

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

size_t PowerOfTwoAtLeast(size_t n) {
  size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

// ---- InternTable ----

uint32_t InternTable::Hash(std::string_view text) {
  // A word at a time, multiply-xorshift mixing: tensor names are short.
  uint64_t h = 0x9E3779B97F4A7C15ull ^ text.size();
  const char* p = text.data();
  size_t n = text.size();
  auto mix = [&h](uint64_t w) {
    h = (h ^ w) * 0xFF51AFD7ED558CCDull;
    h ^= h >> 29;
  };
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    mix(w);
  }
  if (n > 0) {
    uint64_t w = 0;
    if (text.size() >= 8) {
      std::memcpy(&w, text.data() + text.size() - 8, 8);  // the last 8 bytes, overlapping
    } else {
      for (size_t i = 0; i < n; ++i) w |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
    }
    mix(w);
  }
  h *= 0xC4CEB9FE1A85EC53ull;
  return static_cast<uint32_t>(h >> 32);
}

size_t InternTable::SlotOf(std::string_view text, uint32_t hash) const {
  const size_t mask = slots_.size() - 1;
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (s.id < 0 || (s.hash == hash && texts_[s.id] == text)) return i;
  }
}

int InternTable::Find(std::string_view text) const {
  if (slots_.empty()) return -1;
  return slots_[SlotOf(text, Hash(text))].id;
}

int InternTable::Add(std::string_view text) {
  if (2 * (texts_.size() + 1) > slots_.size()) Grow();  // at most half full
  const uint32_t hash = Hash(text);
  Slot& s = slots_[SlotOf(text, hash)];
  if (s.id < 0) {
    s = {hash, static_cast<int32_t>(texts_.size())};
    texts_.emplace_back(text);
  }
  return s.id;
}

void InternTable::Grow() {
  slots_.assign(std::max<size_t>(64, 2 * slots_.size()), Slot{0, -1});
  for (size_t id = 0; id < texts_.size(); ++id) {
    const uint32_t hash = Hash(texts_[id]);
    slots_[SlotOf(texts_[id], hash)] = {hash, static_cast<int32_t>(id)};
  }
}

void InternTable::Clear() {
  slots_.clear();
  texts_.clear();
}

// ---- Timeline: start and stop ----

Timeline::Timeline(size_t ring_words)
    : ring_words_(PowerOfTwoAtLeast(std::max<size_t>(ring_words, 4 * kEndWords))) {}

int64_t Timeline::Now() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Status Timeline::Start(const std::string& path, bool mark_cycles) {
  Stop();
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    return InvalidArgument("cannot write the timeline to '" + path + "': " + std::strerror(errno));
  }
  file_ = f;
  if (!out_) out_.reset(new char[kOutBytes]);
  out_len_ = 0;
  track_names_.clear();
  texts_.clear();
  depth_.assign(1, 0);
  dropped_written_ = 0;
  start_us_ = Now();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (ring_.empty()) {
      // Touched now, so that recording never takes a page fault.
      ring_.assign(ring_words_, 0);
      mask_ = ring_words_ - 1;
    }
    head_ = tail_ = reserved_ = 0;
    stop_ = hold_ = wake_ = false;
    dropped_ = 0;
    run_ = (run_ + 1) & ((1 << (31 - kRunShift)) - 1);
    track_ids_.Clear();
    strings_.Clear();
    strings_.Add("");
    tracks_.assign(1, Track());
  }
  // Every later event starts with ",\n", so the file is one event per line: a reader
  // can recover everything but a torn last line after a crash.
  std::fputs("[\n{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, "
             "\"args\": {\"name\": \"hvdlite rank 0 (coordinator)\"}}",
             file_);
  std::fputs(",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": 0, "
             "\"args\": {\"name\": \"background loop\"}}",
             file_);
  std::fflush(file_);
  mark_cycles_ = mark_cycles;
  writer_ = std::thread(&Timeline::WriterLoop, this);
  active_ = true;
  return Status::OK();
}

void Timeline::Stop() {
  if (!writer_.joinable()) return;
  active_ = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_one();
  writer_.join();
  std::fputs("\n]\n", file_);
  std::fclose(file_);
  file_ = nullptr;
}

void Timeline::HoldWriter(bool hold) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    hold_ = hold;
  }
  cv_.notify_one();
}

void Timeline::WaitWritten() {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t target = head_;
  wake_ = true;
  cv_.notify_one();
  written_.wait(lock, [&] { return tail_ >= target || stop_ || !writer_.joinable(); });
}

int64_t Timeline::dropped() {
  std::lock_guard<std::mutex> lock(mutex_);
  return dropped_;
}

// ---- Timeline: the producer (background loop) ----

template <typename Make>
void Timeline::Produce(Make make) {
  bool notify;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_) return;
    const uint64_t half = ring_words_ / 2;
    const bool below = head_ - tail_ < half;
    make();
    notify = below && head_ - tail_ >= half;
  }
  if (notify) cv_.notify_one();
}

size_t Timeline::Room(size_t reserve) const {
  const uint64_t taken = head_ - tail_ + reserved_ + kHeaderWords;
  if (taken >= ring_words_) return 0;
  return static_cast<size_t>((ring_words_ - taken) / (1 + reserve));
}

int Timeline::TrackOf(std::string_view tensor) {
  const int tid = track_ids_.Add(tensor) + 1;
  if (static_cast<size_t>(tid) == tracks_.size()) tracks_.emplace_back();
  return tid;
}

int Timeline::Follow(const std::string& tensor, int* prev, bool add) {
  int tid = *prev > 0 ? tracks_[*prev].next : 0;
  if (tid == 0 || track_ids_.text(tid - 1) != tensor) {
    tid = add ? TrackOf(tensor) : track_ids_.Find(tensor) + 1;
    if (tid == 0) return 0;
    if (*prev > 0) tracks_[*prev].next = tid;
  }
  *prev = tid;
  return tid;
}

bool Timeline::OpenSpan(Track& track, bool fits) {
  if (track.depth >= 64) fits = false;
  const uint64_t bit = uint64_t{1} << (track.depth & 63);
  track.recorded = fits ? track.recorded | bit : track.recorded & ~bit;
  ++track.depth;
  if (!fits) {
    ++dropped_;
    return false;
  }
  reserved_ += kEndWords;
  return true;
}

bool Timeline::CloseSpan(Track& track) {
  if (track.depth == 0) return false;  // its B was never recorded
  const bool recorded = track.top_recorded();
  --track.depth;
  // Recorded even when the ring is full: its B is in the file, and this is the room
  // set aside for it (an E record of n tracks takes less than n records of one).
  if (recorded) reserved_ -= kEndWords;
  return recorded;
}

void Timeline::Commit(char phase, size_t count, int name, int args, int64_t ts_us,
                      int64_t dur_us) {
  if (count == 0) return;
  auto put = [this](size_t word, uint32_t v) { ring_[(head_ + word) & mask_] = v; };
  put(kPhase, static_cast<uint32_t>(phase));
  put(kCount, static_cast<uint32_t>(count));
  put(kName, static_cast<uint32_t>(name));
  put(kArgs, static_cast<uint32_t>(args));
  put(kTsLow, static_cast<uint32_t>(static_cast<uint64_t>(ts_us)));
  put(kTsHigh, static_cast<uint32_t>(static_cast<uint64_t>(ts_us) >> 32));
  put(kDurLow, static_cast<uint32_t>(static_cast<uint64_t>(dur_us)));
  put(kDurHigh, static_cast<uint32_t>(static_cast<uint64_t>(dur_us) >> 32));
  head_ += kHeaderWords + count;
}

void Timeline::PushAll(const std::string* const* tensors, size_t n, char phase,
                       std::string_view name, std::string_view args, bool only_if_idle) {
  const int64_t ts = Now();
  Produce([&] {
    const size_t room = phase == 'E' ? SIZE_MAX : Room(phase == 'B' ? kEndWords : 0);
    size_t k = 0;
    int prev = 0;
    for (size_t i = 0; i < n; ++i) {
      const int tid = Follow(*tensors[i], &prev, phase != 'E');
      if (phase == 'E') {
        if (tid == 0 || !CloseSpan(tracks_[tid])) continue;
      } else {
        if (phase == 'B') {
          Track& track = tracks_[tid];
          if (only_if_idle && track.depth > 0) continue;
          if (!OpenSpan(track, k < room)) continue;
        } else if (k >= room) {
          ++dropped_;
          continue;
        }
      }
      PutTid(k++, tid);
    }
    Commit(phase, k, strings_.Add(name), strings_.Add(args), ts);
  });
}

std::vector<int> Timeline::OpenTracks(const std::vector<const std::string*>& tensors) {
  std::vector<int> tids;
  if (!active()) return tids;
  tids.reserve(tensors.size());
  std::lock_guard<std::mutex> lock(mutex_);
  int prev = 0;
  for (const std::string* t : tensors) {
    const int tid = Follow(*t, &prev, false);
    if (tid <= 0 || tracks_[tid].depth == 0) continue;
    if (tid >= 1 << kRunShift) {  // beyond 16M tracks: no room in the value
      ++dropped_;
      continue;
    }
    tids.push_back(tid | run_ << kRunShift);
  }
  return tids;
}

void Timeline::Complete(const std::vector<int>& tids, const char* activity, int64_t start_us,
                        int64_t end_us) {
  if (tids.empty() || !active()) return;
  Produce([&] {
    const size_t room = Room(0);
    size_t k = 0;
    for (int value : tids) {
      // Tracks of an earlier run (restarted since OpenTracks) are not this file's.
      if (value >> kRunShift != run_) continue;
      const int tid = value & ((1 << kRunShift) - 1);
      // In the span it belongs to, if that was recorded; else lost with it, and counted.
      if (k < room && tracks_[tid].top_recorded()) {
        PutTid(k++, tid);
      } else {
        ++dropped_;
      }
    }
    Commit('X', k, strings_.Add(activity), 0, start_us, end_us - start_us);
  });
}

void Timeline::EndAll(const std::vector<const std::string*>& tensors) {
  if (active()) PushAll(tensors.data(), tensors.size(), 'E', "", "");
}

void Timeline::BeginOps(const std::vector<const std::string*>& tensors, const char* activity,
                        const std::function<uint64_t(size_t)>& args_key,
                        const std::function<std::string(size_t)>& make_args) {
  if (!active() || tensors.empty()) return;
  const int64_t ts = Now();
  Produce([&] {
    const int name = strings_.Add(activity);
    size_t room = Room(kEndWords);
    size_t k = 0;
    int run_args = -1;  // the args of the record being gathered
    int prev = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const int tid = Follow(*tensors[i], &prev, true);
      Track& track = tracks_[tid];
      const uint64_t key = args_key(i);
      if (track.args < 0 || track.args_key != key) {
        track.args = strings_.Add(make_args(i));
        track.args_key = key;
      }
      if (k > 0 && track.args != run_args) {
        Commit('B', k, name, run_args, ts);
        room = Room(kEndWords);
        k = 0;
      }
      run_args = track.args;
      if (OpenSpan(track, k < room)) PutTid(k++, tid);
    }
    Commit('B', k, name, run_args, ts);
  });
}

void Timeline::BeginNegotiationAll(const std::vector<const std::string*>& tensors,
                                   const char* activity) {
  if (active() && !tensors.empty()) {
    PushAll(tensors.data(), tensors.size(), 'B', activity, "", /*only_if_idle=*/true);
  }
}

void Timeline::InstantAll(const std::vector<const std::string*>& tensors, const char* what,
                          const char* args) {
  if (active() && !tensors.empty()) PushAll(tensors.data(), tensors.size(), 'i', what, args);
}

void Timeline::BeginNegotiation(const std::string& tensor, const std::string& activity) {
  const std::string* t = &tensor;
  if (active()) PushAll(&t, 1, 'B', activity, "", /*only_if_idle=*/true);
}

void Timeline::End(const std::string& tensor) {
  const std::string* t = &tensor;
  if (active()) PushAll(&t, 1, 'E', "", "");
}

void Timeline::Instant(const std::string& tensor, const std::string& what, const std::string& args) {
  const std::string* t = &tensor;
  if (active()) PushAll(&t, 1, 'i', what, args);
}

void Timeline::MarkCycle() {
  if (!active() || !mark_cycles()) return;
  const int64_t ts = Now();
  Produce([&] {
    if (Room(0) == 0) {
      ++dropped_;
      return;
    }
    PutTid(0, 0);  // tid 0: a global mark
    Commit('i', 1, strings_.Add("CYCLE_START"), 0, ts);
  });
}

// ---- Timeline: the writer ----

void Timeline::Append(const char* data, size_t n) {
  if (out_len_ + n > kOutBytes) {
    FlushOut();
    if (n > kOutBytes) {  // a line longer than the buffer (huge args): straight out
      std::fwrite(data, 1, n, file_);
      return;
    }
  }
  std::memcpy(out_.get() + out_len_, data, n);
  out_len_ += n;
}

void Timeline::AppendNumber(int64_t v) {
  char num[24];
  Append(num, static_cast<size_t>(std::to_chars(num, num + sizeof(num), v).ptr - num));
}

void Timeline::FlushOut() {
  std::fwrite(out_.get(), 1, out_len_, file_);
  out_len_ = 0;
}

void Timeline::CopyNewTexts() {
  for (size_t id = track_names_.size(); id < track_ids_.size(); ++id) {
    track_names_.push_back(track_ids_.text(static_cast<int>(id)));
  }
  for (size_t id = texts_.size(); id < strings_.size(); ++id) {
    texts_.push_back(strings_.text(static_cast<int>(id)));
  }
}

void Timeline::NameNewTracks() {
  // Before the batch that uses them: every tid in it was added before it was taken.
  for (size_t tid = depth_.size(); tid <= track_names_.size(); ++tid) {
    const std::string t = std::to_string(tid);
    Append(",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": " + t +
           ", \"args\": {\"name\": \"" + JsonEscape(track_names_[tid - 1]) + "\"}}");
    Append(",\n{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": 0, \"tid\": " + t +
           ", \"args\": {\"sort_index\": " + t + "}}");
  }
  depth_.resize(track_names_.size() + 1, 0);
}

uint64_t Timeline::WriteRecord(uint64_t pos) {
  auto word = [&](size_t i) { return ring_[(pos + i) & mask_]; };
  const char phase = static_cast<char>(word(kPhase));
  const size_t count = word(kCount);
  const std::string& name = texts_[word(kName)];
  const std::string& args = texts_[word(kArgs)];
  const int64_t ts = static_cast<int64_t>(word(kTsLow) | static_cast<uint64_t>(word(kTsHigh)) << 32);
  const int64_t dur =
      static_cast<int64_t>(word(kDurLow) | static_cast<uint64_t>(word(kDurHigh)) << 32);
  const bool global = phase == 'i' && count == 1 && word(kHeaderWords) == 0;

  // What every line of the record shares: its start up to the tid, and the rest.
  char head[] = ",\n{\"ph\": \"?\", \"pid\": 0, \"tid\": ";
  constexpr size_t kHeadLen = sizeof(head) - 1;
  head[10] = phase;
  char num[24];
  line_.assign(", \"ts\": ");
  line_.append(num, std::to_chars(num, num + sizeof(num), ts - start_us_).ptr);
  if (!name.empty()) {
    line_ += ", \"name\": \"";
    line_ += JsonEscape(name);
    line_ += '"';
  }
  if (phase == 'i') line_ += global ? ", \"s\": \"g\"" : ", \"s\": \"t\"";
  if (phase == 'X') {
    line_ += ", \"dur\": ";
    line_.append(num, std::to_chars(num, num + sizeof(num), dur).ptr);
  }
  if (!args.empty()) {
    line_ += ", \"args\": {";
    line_ += args;
    line_ += '}';
  }
  line_ += '}';

  const size_t line_max = kHeadLen + 10 + line_.size();  // 10: the digits of a tid
  for (size_t k = 0; k < count; ++k) {
    const uint32_t tid = word(kHeaderWords + k);
    if (phase == 'B') ++depth_[tid];
    if (phase == 'E') --depth_[tid];
    if (out_len_ + line_max > kOutBytes) FlushOut();
    if (line_max > kOutBytes) {  // a line longer than the buffer (huge args)
      Append(head, kHeadLen);
      AppendNumber(tid);
      Append(line_);
      continue;
    }
    // The common case: straight copies into the buffer, with its room checked once.
    char* p = out_.get() + out_len_;
    std::memcpy(p, head, kHeadLen);
    p = std::to_chars(p + kHeadLen, p + kHeadLen + 10, tid).ptr;
    std::memcpy(p, line_.data(), line_.size());
    out_len_ = static_cast<size_t>(p + line_.size() - out_.get());
  }
  return pos + kHeaderWords + count;
}

void Timeline::WriterLoop() {
#ifdef __linux__
  // Out of the ranks' way: SCHED_BATCH (a wake-up never preempts a running thread) at
  // nice +10 (Linux nice values are per thread). The trace can wait a little; the
  // ring holds seconds of events.
  sched_param param{};
  pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);
  pthread_setname_np(pthread_self(), "hvdlite-trace");
#endif
  while (true) {
    uint64_t from, to;
    bool stopping;
    int64_t dropped;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait_for(lock, kWriterPeriod, [&] {
        return stop_ || (!hold_ && (wake_ || head_ - tail_ >= ring_words_ / 2));
      });
      if (hold_ && !stop_) continue;
      wake_ = false;
      from = tail_;
      to = head_;
      stopping = stop_;
      dropped = dropped_;
      CopyNewTexts();
    }
    // The records in [from, to) are the writer's until tail_ moves past them.
    NameNewTracks();
    for (uint64_t pos = from; pos < to;) pos = WriteRecord(pos);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tail_ = to;
    }
    written_.notify_all();
    const int64_t now = Now() - start_us_;
    if (stopping) {
      // Spans still open now (the timeline stops in the middle of an operation) end
      // here, so every B in the file has its E.
      for (size_t tid = 1; tid < depth_.size(); ++tid) {
        for (; depth_[tid] > 0; --depth_[tid]) {
          Append(",\n{\"ph\": \"E\", \"pid\": 0, \"tid\": ");
          AppendNumber(static_cast<int64_t>(tid));
          Append(", \"ts\": ");
          AppendNumber(now);
          Append("}");
        }
      }
    }
    if (dropped > dropped_written_) {
      // The lines lost since the last count; the file's counts add up to the total.
      Append(",\n{\"ph\": \"i\", \"pid\": 0, \"tid\": 0, \"ts\": ");
      AppendNumber(now);
      Append(", \"s\": \"g\", \"name\": \"EVENTS_DROPPED\", \"args\": {\"count\": ");
      AppendNumber(dropped - dropped_written_);
      Append("}}");
      dropped_written_ = dropped;
    }
    // Flushed every batch: what was written survives a crash.
    FlushOut();
    std::fflush(file_);
    if (stopping) {
      if (dropped > 0) {
        HVDLITE_LOG(WARNING) << "timeline: " << dropped
                             << " events were dropped because the writer fell behind";
      }
      break;
    }
  }
}

}  // namespace hvdlite
