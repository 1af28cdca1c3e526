// Chrome trace (JSON array) of when each tensor was negotiated and reduced, written by
// rank 0. The background loop only pushes events into a bounded queue; a writer thread
// of its own formats and writes them, so the loop never waits on the disk.
//
// Threads: the background loop is the only producer (Begin/End/Complete/Instant/
// MarkCycle), so on each track timestamps appear in the file in non-decreasing order
// (across tracks a complete event, written when it ends, may follow later starts). Start/Stop come from any
// thread, serialized by the caller (Core holds its timeline mutex).
//
// Balance: every B event in the file has its E. The producer side keeps, per track, a
// stack of open spans: an E whose B was never recorded (the timeline started in the
// middle of a span, or rank 0 never saw the tensor's request) is ignored; when the queue
// is full a B is dropped (and counted) together with its E, while an E whose B was
// queued is always queued, so the queue exceeds its bound by at most the open spans.
// Stop closes the spans still open at that moment.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common.h"

namespace hvdlite {

class Timeline {
 public:
  ~Timeline() { Stop(); }
  // Stops a running timeline, then opens (truncates) path. On failure returns an
  // error that names the path and the reason, and no timeline runs.
  Status Start(const std::string& path, bool mark_cycles);
  // Writes what is queued, closes the spans still open, then the closing bracket:
  // the file is valid JSON afterwards. Idempotent.
  void Stop();
  bool active() const { return active_.load(std::memory_order_relaxed); }
  bool mark_cycles() const { return mark_cycles_.load(std::memory_order_relaxed); }

  // Background thread only: spans ('B' ... 'E') and marks on the tensors' tracks; args
  // are the body of a JSON object ("\"bytes\": 4") or "".
  //
  // Opens the tensor's negotiation span unless a span is already open on its track:
  // the first of rank 0's own request and any rank's request reaching the coordinator
  // opens it.
  void BeginNegotiation(const std::string& tensor, const std::string& activity);
  // Begin of an operation span on each of `tensors` (the ops of one collective) at one
  // moment. Tensor i's args depend only on args_key(i), a digest of what they show:
  // make_args(i) formats them the first time its track sees that key, and the repeats
  // of later steps reuse the text. Neighbours with the same args share one queued
  // event (one line per track in the file, as for EndAll).
  void BeginOps(const std::vector<const std::string*>& tensors, const char* activity,
                const std::function<uint64_t(size_t)>& args_key,
                const std::function<std::string(size_t)>& make_args);
  void End(const std::string& tensor);
  // End on many tracks at one moment (a fused collective): one queued event, one line
  // per track in the file.
  void EndAll(const std::vector<const std::string*>& tensors);
  // BeginNegotiation and Instant for many tracks at one moment: one queued event.
  void BeginNegotiationAll(const std::vector<const std::string*>& tensors, const char* activity);
  void InstantAll(const std::vector<const std::string*>& tensors, const char* what, const char* args);
  // Microseconds on the timeline's clock, for the start and end times given to Complete.
  static int64_t Now();
  // The tracks of these tensors whose operation span is recorded and open: where the
  // activities of their execution go. Empty when the timeline is off.
  std::vector<int> OpenTracks(const std::vector<const std::string*>& tensors);
  // One activity from start_us to end_us on each of these tracks (from OpenTracks): a
  // single queued event, written as one complete ('X') line per track. Activities are
  // recorded once they have ended, so they need no bookkeeping of open spans and take
  // half the lines of a B/E pair.
  void Complete(const std::vector<int>& tids, const char* activity, int64_t start_us,
                int64_t end_us);
  // An instant mark on the tensor's track.
  void Instant(const std::string& tensor, const std::string& what, const std::string& args = "");
  // A global instant per background cycle, when started with mark_cycles.
  void MarkCycle();

 private:
  struct Event {
    char phase;  // 'B', 'E', 'X', 'i', or 'M' (a new track: name is the tensor name)
    int tid;
    std::string name, args;
    int64_t ts_us;
    std::vector<int> tids;  // a group event: one line per track (tid unused)
    int64_t dur_us = 0;     // 'X' only
  };
  // Producer-side state of one track. Guarded by mutex_.
  struct Track {
    int tid;
    std::vector<bool> open;  // one entry per open B: was it queued (true) or dropped
    bool has_args = false;   // BeginOp's last args, and their key
    uint64_t args_key = 0;
    std::string args;
  };
  Track& TrackOf(const std::string& tensor);  // needs mutex_
  // Needs mutex_: updates the track's stack; returns the tid, or -1 if the event is
  // not to be written (orphan E, or dropped because the queue is full).
  // track, when given, receives the tensor's Track for B and i events.
  int Admit(const std::string& tensor, char phase, bool only_if_idle, Track** track = nullptr);
  void Push(const std::string& tensor, char phase, std::string name, std::string args,
            bool only_if_idle = false);
  // Under the lock, unless stopped: make() queues the events (none, one or several);
  // the writer is woken when the queue reaches half its bound.
  template <typename Make>
  void Produce(Make make);
  void PushAll(const std::vector<const std::string*>& tensors, char phase, const char* name,
               const char* args = "", bool only_if_idle = false);
  void WriterLoop();
  void Write(const Event& e);  // writer thread only
  void WriteLine(char phase, int tid, int64_t ts_us, const std::string& tail);

  std::atomic<bool> active_{false};
  std::atomic<bool> mark_cycles_{false};
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Event> queue_;                       // Guarded by mutex_.
  std::unordered_map<std::string, Track> tracks_;  // Guarded by mutex_.
  bool stop_ = false;                             // Guarded by mutex_.
  int64_t dropped_ = 0;                           // Guarded by mutex_.
  std::thread writer_;
  std::FILE* file_ = nullptr;  // Writer thread only while it runs; Start/Stop otherwise.
  std::vector<int> depth_;     // Writer thread only: open spans per tid, to close at Stop.
  std::string line_;           // Writer thread only: the part of a line after "ts".
  std::string out_;            // Writer thread only: the batch being formatted.
  int64_t start_us_ = 0;       // Set by Start before the writer and producers see it.
};

}  // namespace hvdlite
