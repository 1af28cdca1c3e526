// Chrome trace (JSON array) of when each tensor was negotiated and reduced, written by
// rank 0. The background loop only appends fixed-layout binary records (event kind,
// interned track and string ids, timestamps) to a ring allocated once; a writer thread
// of its own turns them into JSON in large batches, so the loop never formats, allocates
// or waits on the disk.
//
// Threads: the background loop is the only producer (Begin/End/Complete/Instant/
// MarkCycle), so on each track timestamps appear in the file in non-decreasing order
// (across tracks a complete event, written when it ends, may follow later starts).
// Start/Stop come from any thread, serialized by the caller (Core holds its timeline
// mutex).
//
// Balance and loss: every B event in the file has its E. The producer side keeps, per
// track, a stack of open spans: an E whose B was never recorded (the timeline started in
// the middle of a span, or rank 0 never saw the tensor's request) is ignored. A B is
// recorded only with room for its E set aside in the ring, so an E whose B was recorded
// is always recorded; when the ring is full, a B (with its E), a mark or an activity is
// dropped and counted, and the writer puts the count in the file (an EVENTS_DROPPED
// mark per batch that lost any). Stop closes the spans still open at that moment.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/common.h"

namespace hvdlite {

// Strings numbered from 0 in order of arrival and found again by their text: the
// timeline's tensor names and its events' names and args. Open addressing over a
// power-of-two table of (hash, id): a lookup hashes the text a word at a time and
// compares it once, with no allocation, division or node to chase (the loop looks
// each tensor up several times a step). Not thread-safe: its owner guards it.
class InternTable {
 public:
  // The id of text, or -1 when it was never added.
  int Find(std::string_view text) const;
  // The id of text, added with the next id when new.
  int Add(std::string_view text);
  const std::string& text(int id) const { return texts_[id]; }
  size_t size() const { return texts_.size(); }
  void Clear();

 private:
  struct Slot {
    uint32_t hash;
    int32_t id;  // -1: empty
  };
  static uint32_t Hash(std::string_view text);
  // The slot holding text, or the empty slot where it would go.
  size_t SlotOf(std::string_view text, uint32_t hash) const;
  void Grow();

  std::vector<Slot> slots_;
  std::vector<std::string> texts_;
};

class Timeline {
 public:
  // The ring's size in 32-bit words (a power of two): 8 MiB, a few seconds of the
  // 200-tensor step's events should the writer be kept off the CPU.
  static constexpr size_t kDefaultRingWords = size_t{1} << 21;

  // ring_words (rounded up to a power of two) is allocated at the first Start and kept.
  explicit Timeline(size_t ring_words = kDefaultRingWords);
  ~Timeline() { Stop(); }
  // Stops a running timeline, then opens (truncates) path. On failure returns an
  // error that names the path and the reason, and no timeline runs.
  Status Start(const std::string& path, bool mark_cycles);
  // Writes what is recorded, closes the spans still open, then the closing bracket:
  // the file is valid JSON afterwards. Idempotent.
  void Stop();
  bool active() const { return active_.load(std::memory_order_relaxed); }
  bool mark_cycles() const { return mark_cycles_.load(std::memory_order_relaxed); }

  // The cycle's thread only (core/loop.cc): spans ('B' ... 'E') and marks on the tensors' tracks; args
  // are the body of a JSON object ("\"bytes\": 4") or "". Names and args are interned:
  // callers pass a bounded set of texts (activity names, one args text per shape).
  //
  // Opens the tensor's negotiation span unless a span is already open on its track:
  // the first of rank 0's own request and any rank's request reaching the coordinator
  // opens it.
  void BeginNegotiation(const std::string& tensor, const std::string& activity);
  // Begin of an operation span on each of `tensors` (the ops of one collective) at one
  // moment. Tensor i's args depend only on args_key(i), a digest of what they show:
  // make_args(i) formats them the first time its track sees that key, and the repeats
  // of later steps reuse the interned text. Neighbours with the same args share one
  // record (one line per track in the file, as for EndAll).
  void BeginOps(const std::vector<const std::string*>& tensors, const char* activity,
                const std::function<uint64_t(size_t)>& args_key,
                const std::function<std::string(size_t)>& make_args);
  void End(const std::string& tensor);
  // End on many tracks at one moment (a fused collective): one record, one line per
  // track in the file.
  void EndAll(const std::vector<const std::string*>& tensors);
  // BeginNegotiation and Instant for many tracks at one moment: one record.
  void BeginNegotiationAll(const std::vector<const std::string*>& tensors, const char* activity);
  void InstantAll(const std::vector<const std::string*>& tensors, const char* what, const char* args);
  // Microseconds on the timeline's clock, for the start and end times given to Complete.
  static int64_t Now();
  // The tracks of these tensors with an operation span open: where the activities of
  // their execution go (those of a span dropped for want of room are counted as
  // dropped too). Empty when the timeline is off. Valid until the next Start: the
  // values also name the run of the timeline they belong to.
  std::vector<int> OpenTracks(const std::vector<const std::string*>& tensors);
  // One activity from start_us to end_us on each of these tracks (from OpenTracks): a
  // single record, written as one complete ('X') line per track. Activities are
  // recorded once they have ended, so they need no bookkeeping of open spans and take
  // half the lines of a B/E pair.
  void Complete(const std::vector<int>& tids, const char* activity, int64_t start_us,
                int64_t end_us);
  // An instant mark on the tensor's track.
  void Instant(const std::string& tensor, const std::string& what, const std::string& args = "");
  // A global instant per background cycle, when started with mark_cycles.
  void MarkCycle();

  // Tests only (testing_api.cc), from the producing thread: while held, the writer
  // takes nothing from the ring (so a small ring overflows); Stop releases it.
  void HoldWriter(bool hold);
  // Tests only: waits until the writer has written everything recorded so far.
  void WaitWritten();
  // Per-track lines dropped since Start because the ring was full.
  int64_t dropped();

 private:
  // A record: kHeaderWords words, then the tid of each of its kCount tracks.
  enum Word : size_t { kPhase, kCount, kName, kArgs, kTsLow, kTsHigh, kDurLow, kDurHigh,
                       kHeaderWords };
  // Room set aside for the E of a recorded B: a record of its own at most.
  static constexpr size_t kEndWords = kHeaderWords + 1;
  // OpenTracks' values: the tid in the low bits, the run (Start) above them.
  static constexpr int kRunShift = 24;
  // Producer-side state of one track. Guarded by mutex_.
  struct Track {
    // The stack of open spans, without an allocation: `depth` spans, bit d of
    // `recorded` says whether the d-th (from the bottom) was recorded or dropped.
    // Spans nest two deep in the loop; beyond 64 they are dropped (and counted).
    uint32_t depth = 0;
    uint64_t recorded = 0;
    bool top_recorded() const { return depth > 0 && depth <= 64 && (recorded >> (depth - 1) & 1); }
    uint64_t args_key = 0;   // BeginOps' last args key, and its interned args (-1: none)
    int args = -1;
    int next = 0;  // the track that followed this one in the last call naming both
  };

  // Everything below marked "needs mutex_" runs inside Produce.
  // Under the lock, unless stopped: make() appends records; the writer is woken when
  // the ring gets half full.
  template <typename Make>
  void Produce(Make make);
  // Needs mutex_: how many tracks the next record may hold, each also setting aside
  // `reserve` words, without eating into the room kept for the open spans' ends.
  size_t Room(size_t reserve) const;
  int TrackOf(std::string_view tensor);  // needs mutex_: its tid (from 1), added if new
  // Needs mutex_: the tid of the tensor named after the one of tid *prev in a call (0
  // at its start), added if new and `add`, else 0 when unknown. The loop names the
  // same tensors in the same order step after step, so the track that followed *prev
  // last time is tried first: one comparison of the name instead of a table lookup.
  int Follow(const std::string& tensor, int* prev, bool add);
  // Needs mutex_: a B on the track; true if recorded (then its E's room is set aside).
  bool OpenSpan(Track& track, bool fits);
  // Needs mutex_: an E on the track; true if its B was recorded (the E then is too).
  bool CloseSpan(Track& track);
  // Needs mutex_: the k-th track of the record being appended at head_.
  void PutTid(size_t k, int tid) { ring_[(head_ + kHeaderWords + k) & mask_] = tid; }
  // Needs mutex_: completes the record of `count` tracks put at head_ (none: nothing).
  void Commit(char phase, size_t count, int name, int args, int64_t ts_us, int64_t dur_us = 0);
  void PushAll(const std::string* const* tensors, size_t n, char phase, std::string_view name,
               std::string_view args, bool only_if_idle = false);

  // Writer thread.
  void WriterLoop();
  // Copies the texts interned since the last batch (needs mutex_) ...
  void CopyNewTexts();
  // ... and names the new tracks in the file.
  void NameNewTracks();
  uint64_t WriteRecord(uint64_t pos);  // returns the next record's position
  void Append(const char* data, size_t n);
  void Append(std::string_view s) { Append(s.data(), s.size()); }
  void AppendNumber(int64_t v);
  void FlushOut();

  const size_t ring_words_;
  std::atomic<bool> active_{false};
  std::atomic<bool> mark_cycles_{false};
  std::mutex mutex_;
  std::condition_variable cv_;       // wakes the writer
  std::condition_variable written_;  // the writer has moved tail_
  std::vector<uint32_t> ring_;       // records in [tail_, head_) (positions mod its size)
  size_t mask_ = 0;
  uint64_t head_ = 0;      // Guarded by mutex_. Words ever appended.
  uint64_t tail_ = 0;      // Guarded by mutex_. Words ever written out.
  uint64_t reserved_ = 0;  // Guarded by mutex_. Words kept for the ends of recorded open spans.
  InternTable track_ids_;  // Guarded by mutex_. Tensor name -> tid - 1.
  InternTable strings_;    // Guarded by mutex_. Event names and args; id 0 is "".
  std::vector<Track> tracks_;  // Guarded by mutex_. By tid (0: the loop's own track).
  bool stop_ = false;          // Guarded by mutex_.
  bool hold_ = false;          // Guarded by mutex_.
  bool wake_ = false;          // Guarded by mutex_. WaitWritten wants a batch now.
  int64_t dropped_ = 0;        // Guarded by mutex_.
  int run_ = 0;                // Guarded by mutex_. Counts Starts (mod 2^(31 - kRunShift)).
  std::thread writer_;

  // Writer thread only while it runs; Start/Stop otherwise.
  std::FILE* file_ = nullptr;
  std::vector<std::string> track_names_;  // copies of track_ids_' texts, by tid - 1
  std::vector<std::string> texts_;        // copies of strings_' texts
  std::vector<int> depth_;                // open spans per tid, to close at Stop
  int64_t dropped_written_ = 0;           // the dropped lines already counted in the file
  std::string line_;                      // the part of a record's lines after the tid
  std::unique_ptr<char[]> out_;           // the batch being formatted
  size_t out_len_ = 0;
  int64_t start_us_ = 0;  // Set by Start before the writer and producers see it.
};

}  // namespace hvdlite
