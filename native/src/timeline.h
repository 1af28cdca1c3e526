// Chrome trace (JSON array) of when each tensor was negotiated and reduced. The
// background loop only pushes events into a bounded queue; a writer thread of its own
// formats and writes them, so the loop never waits on the disk. When the queue is
// full, events are dropped and counted. Rank 0 records.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "common.h"

namespace hvdlite {

class Timeline {
 public:
  ~Timeline() { Stop(); }
  Status Start(const std::string& path, bool mark_cycles);
  void Stop();
  bool active() const { return active_.load(std::memory_order_relaxed); }
  bool mark_cycles() const { return mark_cycles_; }

  // Phase 'B'/'E' events on the tensor's track; args is a JSON object body or "".
  void Begin(const std::string& tensor, const std::string& activity, const std::string& args = "");
  void End(const std::string& tensor);
  void Instant(const std::string& tensor, const std::string& what);
  void MarkCycle();

 private:
  struct Event {
    char phase;
    std::string tensor, name, args;
    int64_t ts_us;
  };
  void Push(Event e);
  void WriterLoop();
  int64_t NowUs() const;

  std::atomic<bool> active_{false};
  bool mark_cycles_ = false;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Event> queue_;  // Guarded by mutex_.
  bool stop_ = false;        // Guarded by mutex_.
  int64_t dropped_ = 0;      // Guarded by mutex_.
  std::thread writer_;
  std::FILE* file_ = nullptr;                    // Writer thread only (after Start).
  std::unordered_map<std::string, int> tracks_;  // Writer thread only.
  bool first_event_ = true;                      // Writer thread only.
  int64_t start_us_ = 0;
};

}  // namespace hvdlite
