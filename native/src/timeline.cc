#include "timeline.h"

#include <cerrno>
#include <chrono>
#include <cstring>

namespace hvdlite {
namespace {

constexpr size_t kMaxQueued = 1 << 16;

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

int64_t Timeline::NowUs() const {
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
  mark_cycles_ = mark_cycles;
  tracks_.clear();
  first_event_ = true;
  start_us_ = NowUs();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = false;
    dropped_ = 0;
    queue_.clear();
  }
  std::fputs("[\n", file_);
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

void Timeline::Push(Event e) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.size() >= kMaxQueued) {
      ++dropped_;
      return;
    }
    queue_.push_back(std::move(e));
  }
  cv_.notify_one();
}

void Timeline::Begin(const std::string& tensor, const std::string& activity, const std::string& args) {
  if (active()) Push({'B', tensor, activity, args, NowUs()});
}

void Timeline::End(const std::string& tensor) {
  if (active()) Push({'E', tensor, "", "", NowUs()});
}

void Timeline::Instant(const std::string& tensor, const std::string& what) {
  if (active()) Push({'i', tensor, what, "", NowUs()});
}

void Timeline::MarkCycle() {
  if (active() && mark_cycles_) Push({'i', "", "CYCLE_START", "", NowUs()});
}

void Timeline::WriterLoop() {
  std::deque<Event> batch;
  while (true) {
    bool stopping;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait_for(lock, std::chrono::milliseconds(200), [&] { return stop_ || !queue_.empty(); });
      batch.swap(queue_);
      stopping = stop_;
    }
    for (const Event& e : batch) {
      int tid = 0;
      if (!e.tensor.empty()) {
        auto it = tracks_.find(e.tensor);
        if (it == tracks_.end()) {
          tid = static_cast<int>(tracks_.size()) + 1;
          tracks_.emplace(e.tensor, tid);
          std::fprintf(file_,
                       "%s{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": %d, "
                       "\"args\": {\"name\": \"%s\"}}",
                       first_event_ ? "" : ",\n", tid, JsonEscape(e.tensor).c_str());
          first_event_ = false;
        } else {
          tid = it->second;
        }
      }
      std::string line = std::string(first_event_ ? "" : ",\n") + "{\"ph\": \"" + e.phase +
                         "\", \"pid\": 0, \"tid\": " + std::to_string(tid) +
                         ", \"ts\": " + std::to_string(e.ts_us - start_us_);
      if (!e.name.empty()) line += ", \"name\": \"" + JsonEscape(e.name) + "\"";
      if (e.phase == 'i') line += ", \"s\": \"" + std::string(e.tensor.empty() ? "g" : "t") + "\"";
      if (!e.args.empty()) line += ", \"args\": {" + e.args + "}";
      line += "}";
      std::fputs(line.c_str(), file_);
      first_event_ = false;
    }
    batch.clear();
    // Flushed every batch: what was written survives a crash.
    std::fflush(file_);
    if (stopping) break;
  }
}

}  // namespace hvdlite
