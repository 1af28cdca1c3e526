#include "timeline.h"

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>

#ifdef __linux__
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hvdlite {
namespace {

// Events waiting for the writer; beyond this, new spans and marks are dropped.
constexpr size_t kMaxQueued = 1 << 16;
// The writer wakes this often (or when the queue is half full) and flushes each batch,
// so a crash loses at most this much of the end of the trace.
constexpr auto kWriterPeriod = std::chrono::milliseconds(50);

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

}  // namespace

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
  depth_.assign(1, 0);
  start_us_ = Now();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = false;
    dropped_ = 0;
    queue_.clear();
    tracks_.clear();
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

Timeline::Track& Timeline::TrackOf(const std::string& tensor) {
  auto it = tracks_.find(tensor);
  if (it != tracks_.end()) return it->second;
  int tid = static_cast<int>(tracks_.size()) + 1;
  // The track's name travels with its first event, even when the queue is full:
  // a track without a name would be unreadable.
  queue_.push_back({'M', tid, tensor, "", 0, {}});
  return tracks_.emplace(tensor, Track{tid, {}, false, 0, {}}).first->second;
}

int Timeline::Admit(const std::string& tensor, char phase, bool only_if_idle, Track** out) {
  const bool full = queue_.size() >= kMaxQueued;
  if (tensor.empty()) {  // a global mark
    if (full) ++dropped_;
    return full ? -1 : 0;
  }
  if (phase == 'E') {
    auto it = tracks_.find(tensor);
    if (it == tracks_.end() || it->second.open.empty()) return -1;  // its B was never recorded
    bool queued = it->second.open.back();
    it->second.open.pop_back();
    // Queued even when the queue is full: its B is in the file.
    return queued ? it->second.tid : -1;
  }
  Track& track = TrackOf(tensor);
  if (out) *out = &track;
  if (phase == 'B') {
    if (only_if_idle && !track.open.empty()) return -1;
    track.open.push_back(!full);
  }
  if (full) {
    ++dropped_;
    return -1;
  }
  return track.tid;
}

template <typename Make>
void Timeline::Produce(Make make) {
  bool notify;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_) return;
    const size_t before = queue_.size();
    make();
    notify = before < kMaxQueued / 2 && queue_.size() >= kMaxQueued / 2;
  }
  if (notify) cv_.notify_one();
}

void Timeline::Push(const std::string& tensor, char phase, std::string name, std::string args,
                    bool only_if_idle) {
  int64_t ts = Now();
  Produce([&] {
    int tid = Admit(tensor, phase, only_if_idle);
    if (tid >= 0) queue_.push_back({phase, tid, std::move(name), std::move(args), ts, {}});
  });
}

void Timeline::PushAll(const std::vector<const std::string*>& tensors, char phase,
                       const char* name, const char* args, bool only_if_idle) {
  int64_t ts = Now();
  Produce([&] {
    std::vector<int> tids;
    tids.reserve(tensors.size());
    for (const std::string* t : tensors) {
      int tid = Admit(*t, phase, only_if_idle);
      if (tid >= 0) tids.push_back(tid);
    }
    if (!tids.empty()) queue_.push_back({phase, 0, name ? name : "", args, ts, std::move(tids)});
  });
}

std::vector<int> Timeline::OpenTracks(const std::vector<const std::string*>& tensors) {
  std::vector<int> tids;
  if (!active()) return tids;
  tids.reserve(tensors.size());
  std::lock_guard<std::mutex> lock(mutex_);
  for (const std::string* t : tensors) {
    auto it = tracks_.find(*t);
    if (it != tracks_.end() && !it->second.open.empty() && it->second.open.back()) {
      tids.push_back(it->second.tid);
    }
  }
  return tids;
}

void Timeline::Complete(const std::vector<int>& tids, const char* activity, int64_t start_us,
                        int64_t end_us) {
  if (tids.empty() || !active()) return;
  Produce([&] {
    if (queue_.size() >= kMaxQueued) {
      ++dropped_;
      return;
    }
    queue_.push_back({'X', 0, activity, "", start_us, tids, end_us - start_us});
  });
}

void Timeline::EndAll(const std::vector<const std::string*>& tensors) {
  if (active()) PushAll(tensors, 'E', nullptr);
}

void Timeline::BeginOps(const std::vector<const std::string*>& tensors, const char* activity,
                        const std::function<uint64_t(size_t)>& args_key,
                        const std::function<std::string(size_t)>& make_args) {
  if (!active() || tensors.empty()) return;
  int64_t ts = Now();
  Produce([&] {
    const std::string* run_args = nullptr;  // the args of the event being gathered
    Event run{'B', 0, activity, "", ts, {}};
    auto flush = [&] {
      if (run.tids.empty()) return;
      run.args = *run_args;
      queue_.push_back(std::move(run));
      run = Event{'B', 0, activity, "", ts, {}};
    };
    for (size_t i = 0; i < tensors.size(); ++i) {
      Track* track = nullptr;
      int tid = Admit(*tensors[i], 'B', false, &track);
      if (tid < 0) continue;
      const uint64_t key = args_key(i);
      if (!track->has_args || track->args_key != key) {
        track->args = make_args(i);
        track->args_key = key;
        track->has_args = true;
      }
      if (run_args && *run_args != track->args) flush();
      run_args = &track->args;
      run.tids.push_back(tid);
    }
    flush();
  });
}

void Timeline::BeginNegotiationAll(const std::vector<const std::string*>& tensors,
                                   const char* activity) {
  if (active() && !tensors.empty()) PushAll(tensors, 'B', activity, "", /*only_if_idle=*/true);
}

void Timeline::InstantAll(const std::vector<const std::string*>& tensors, const char* what,
                          const char* args) {
  if (active() && !tensors.empty()) PushAll(tensors, 'i', what, args);
}

void Timeline::BeginNegotiation(const std::string& tensor, const std::string& activity) {
  if (active()) Push(tensor, 'B', activity, "", /*only_if_idle=*/true);
}

void Timeline::End(const std::string& tensor) {
  if (active()) Push(tensor, 'E', "", "");
}

void Timeline::Instant(const std::string& tensor, const std::string& what, const std::string& args) {
  if (active()) Push(tensor, 'i', what, args);
}

void Timeline::MarkCycle() {
  if (active() && mark_cycles()) Push("", 'i', "CYCLE_START", "");
}

void Timeline::WriteLine(char phase, int tid, int64_t ts_us, const std::string& tail) {
  if (phase == 'B') ++depth_[tid];
  if (phase == 'E') --depth_[tid];
  // Hand-formatted into the batch buffer: the writer shares the CPU with the ranks.
  char num[24];
  out_ += ",\n{\"ph\": \"";
  out_ += phase;
  out_ += "\", \"pid\": 0, \"tid\": ";
  out_.append(num, std::to_chars(num, num + sizeof(num), tid).ptr);
  out_ += ", \"ts\": ";
  out_.append(num, std::to_chars(num, num + sizeof(num), ts_us - start_us_).ptr);
  out_ += tail;
}

void Timeline::Write(const Event& e) {
  if (e.phase == 'M') {
    if (static_cast<size_t>(e.tid) >= depth_.size()) depth_.resize(e.tid + 1, 0);
    std::string tid = std::to_string(e.tid);
    out_ += ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": " + tid +
            ", \"args\": {\"name\": \"" + JsonEscape(e.name) + "\"}}";
    out_ += ",\n{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": 0, \"tid\": " + tid +
            ", \"args\": {\"sort_index\": " + tid + "}}";
    return;
  }
  // What follows the timestamp; shared by every line of a group event.
  line_.clear();
  if (!e.name.empty()) {
    line_ += ", \"name\": \"";
    line_ += JsonEscape(e.name);
    line_ += '"';
  }
  if (e.phase == 'i') line_ += e.tid == 0 && e.tids.empty() ? ", \"s\": \"g\"" : ", \"s\": \"t\"";
  if (e.phase == 'X') {
    char num[24];
    line_ += ", \"dur\": ";
    line_.append(num, std::to_chars(num, num + sizeof(num), e.dur_us).ptr);
  }
  if (!e.args.empty()) {
    line_ += ", \"args\": {";
    line_ += e.args;
    line_ += '}';
  }
  line_ += '}';
  if (e.tids.empty()) {
    WriteLine(e.phase, e.tid, e.ts_us, line_);
  } else {
    for (int tid : e.tids) WriteLine(e.phase, tid, e.ts_us, line_);
  }
}

void Timeline::WriterLoop() {
#ifdef __linux__
  // Lower this thread's priority (Linux nice values are per thread): the trace can wait
  // a few ms, the ranks' threads on a busy machine should not.
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);
#endif
  std::deque<Event> batch;
  while (true) {
    bool stopping;
    int64_t dropped;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait_for(lock, kWriterPeriod,
                   [&] { return stop_ || queue_.size() >= kMaxQueued / 2; });
      batch.swap(queue_);
      stopping = stop_;
      dropped = dropped_;
    }
    for (const Event& e : batch) Write(e);
    batch.clear();
    std::fwrite(out_.data(), 1, out_.size(), file_);
    out_.clear();
    if (stopping) {
      // Spans still open now (the timeline stops in the middle of an operation) end
      // here, so every B in the file has its E.
      int64_t now = Now();
      for (size_t tid = 1; tid < depth_.size(); ++tid) {
        for (; depth_[tid] > 0; --depth_[tid]) {
          std::fprintf(file_, ",\n{\"ph\": \"E\", \"pid\": 0, \"tid\": %zu, \"ts\": %lld}", tid,
                       static_cast<long long>(now - start_us_));
        }
      }
      if (dropped > 0) {
        std::fprintf(file_,
                     ",\n{\"ph\": \"i\", \"pid\": 0, \"tid\": 0, \"ts\": %lld, \"s\": \"g\", "
                     "\"name\": \"EVENTS_DROPPED\", \"args\": {\"count\": %lld}}",
                     static_cast<long long>(now - start_us_), static_cast<long long>(dropped));
        HVDLITE_LOG(WARNING) << "timeline: " << dropped
                             << " events were dropped because the writer fell behind";
      }
    }
    // Flushed every batch: what was written survives a crash.
    std::fflush(file_);
    if (stopping) break;
  }
}

}  // namespace hvdlite
