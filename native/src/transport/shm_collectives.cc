#include "transport/shm_collectives.h"

#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/elementwise.h"
#include "common/thread_sched.h"
#include "transport/mpi_fault_guard.h"

namespace hvdlite {
namespace {

// The barrier's shared state, at the start of rank 0's segment.
struct Control {
  alignas(64) std::atomic<int32_t> count;
  alignas(64) std::atomic<int32_t> sense;     // a futex word: sleepers wait on it
  alignas(64) std::atomic<int32_t> sleepers;  // ranks in (or about to be in) futex wait
};
static_assert(sizeof(Control) <= ShmCollectives::kControlBytes, "the control block must fit its area");

// How far a rank's Allreduce has got, in chunks counted over every call (the same
// sequence on every rank), in its own segment after the barrier's area. Peers that
// wait for it sleep on seq, which goes up at every step published.
struct Progress {
  alignas(64) std::atomic<int64_t> copied_in;   // chunks whose in slot is filled
  std::atomic<int64_t> reduced;                 // chunks whose part is in the out slot
  std::atomic<int64_t> copied_out;              // chunks copied into the outputs
  alignas(64) std::atomic<int32_t> seq;         // a futex word
  std::atomic<int32_t> sleepers;                // peers in (or about to be in) futex wait
};
constexpr int64_t kProgressOffset = 1024;
static_assert(sizeof(Control) <= kProgressOffset, "the progress block follows the control block");
static_assert(kProgressOffset + sizeof(Progress) <= ShmCollectives::kControlBytes,
              "the progress block must fit the control area");
static_assert(std::atomic<int64_t>::is_always_lock_free,
              "the progress counters need lock-free atomics to work across processes");
static_assert(std::atomic<int32_t>::is_always_lock_free,
              "the barrier needs lock-free atomics to work across processes");

// Sleeps while *word == expected, at most timeout_us (shared between processes: no
// FUTEX_PRIVATE_FLAG). Returns early when woken, on a signal, or if the word changed.
void FutexWait(std::atomic<int32_t>* word, int32_t expected, int64_t timeout_us) {
  struct timespec ts = {static_cast<time_t>(timeout_us / 1000000), (timeout_us % 1000000) * 1000L};
  syscall(SYS_futex, reinterpret_cast<int32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

// How long a wait polls before it sleeps (ShmCollectives::poll_). A peer in step with
// us (a blocking collective's usual case) is there within a few microseconds, while a
// futex sleep and its wake-up on another core cost tens (20-60 us on this project's
// 2-core machine, where an idle core must be woken; a small allreduce waits three or
// four times). Bounded, so a peer still computing costs at most kPollUs of a core per
// wait, and only of a core whose framework thread is blocked anyway.
constexpr auto kPollUs = std::chrono::microseconds(50);

void FutexWakeAll(std::atomic<int32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<int32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

bool ProcessAlive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  // An exited child not yet reaped by its parent (the launcher) is a zombie.
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  std::FILE* f = std::fopen(path, "r");
  if (!f) return true;  // no /proc: trust kill()
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* paren = std::strrchr(buf, ')');  // the state follows the command name
  return !(paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X'));
}

}  // namespace

ShmCollectives::ShmCollectives(int rank, std::vector<uint8_t*> segments, std::vector<int64_t> pids,
                               std::vector<int> global_ranks)
    : rank_(rank), size_(static_cast<int>(segments.size())), segments_(std::move(segments)),
      pids_(std::move(pids)), global_ranks_(std::move(global_ranks)) {}

uint8_t* ShmCollectives::In(int rank, int set) const {
  return segments_[rank] + kHeaderBytes + static_cast<int64_t>(set) * 2 * kChunkBytes;
}

uint64_t* ShmCollectives::Bits(int rank, int set) const {
  return reinterpret_cast<uint64_t*>(segments_[rank] + kControlBytes) + set * kMaxBitsWords;
}

uint8_t* ShmCollectives::Out(int rank, int set) const { return In(rank, set) + kChunkBytes; }

int64_t* ShmCollectives::CompanionHead(int rank, int set) const {
  return reinterpret_cast<int64_t*>(segments_[rank] + kControlBytes + 2 * kMaxBitsWords * 8 +
                                    set * kCompanionArea);
}

uint8_t* ShmCollectives::Companion() const {
  return reinterpret_cast<uint8_t*>(CompanionHead(rank_, bits_set_)) + 64;
}

int64_t ShmCollectives::PeerCompanion(int k, const uint8_t** data, int64_t* bytes) const {
  const int64_t* head = CompanionHead(k, bits_set_ ^ 1);  // AndBits flipped bits_set_
  *data = reinterpret_cast<const uint8_t*>(head) + 64;
  *bytes = head[1];
  return head[0];
}

int ShmCollectives::DeadPeer() const {
  for (int k = 0; k < size_; ++k) {
    if (k != rank_ && !ProcessAlive(pids_[k])) return k;
  }
  return -1;
}

namespace {
Progress* ProgressOf(uint8_t* segment) { return reinterpret_cast<Progress*>(segment + kProgressOffset); }
}  // namespace

void ShmCollectives::Publish(int field, int64_t chunks) {
  Progress* p = ProgressOf(segments_[rank_]);
  std::atomic<int64_t>* f = field == 0 ? &p->copied_in : field == 1 ? &p->reduced : &p->copied_out;
  f->store(chunks, std::memory_order_seq_cst);
  p->seq.fetch_add(1, std::memory_order_seq_cst);
  // Sequentially consistent with the waiters' increment, as in Meet.
  if (p->sleepers.load(std::memory_order_seq_cst) > 0) FutexWakeAll(&p->seq);
}

Status ShmCollectives::WaitFor(int field, int64_t chunks) {
  for (int k = 0; k < size_; ++k) {
    if (k == rank_) continue;
    Progress* p = ProgressOf(segments_[k]);
    const std::atomic<int64_t>* f = field == 0 ? &p->copied_in : field == 1 ? &p->reduced : &p->copied_out;
    if (poll_) PollUntil(kPollUs, [&] { return f->load(std::memory_order_acquire) >= chunks; });
    while (f->load(std::memory_order_acquire) < chunks) {
      p->sleepers.fetch_add(1, std::memory_order_seq_cst);
      const int32_t seq = p->seq.load(std::memory_order_seq_cst);
      if (f->load(std::memory_order_seq_cst) < chunks) FutexWait(&p->seq, seq, idle_ ? kIdleWakeUs : 100000);
      p->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (f->load(std::memory_order_acquire) >= chunks) break;
      Status s = AfterWait();
      if (!s.ok()) return s;
    }
  }
  return Status::OK();
}

Status ShmCollectives::Meet() {
  Control* c = reinterpret_cast<Control*>(segments_[0]);
  sense_ ^= 1;
  if (c->count.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
    c->count.store(0, std::memory_order_relaxed);
    c->sense.store(sense_, std::memory_order_seq_cst);
    // Sequentially consistent with the sleepers' increment: either a sleeper sees the
    // new sense before it waits, or this sees the sleeper and wakes it.
    if (c->sleepers.load(std::memory_order_seq_cst) > 0) FutexWakeAll(&c->sense);
    return Status::OK();
  }
  const int32_t old_sense = sense_ ^ 1;
  if (poll_ && PollUntil(kPollUs, [&] { return c->sense.load(std::memory_order_acquire) == sense_; })) {
    return Status::OK();
  }
  while (true) {
    c->sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (c->sense.load(std::memory_order_seq_cst) == old_sense) FutexWait(&c->sense, old_sense, idle_ ? kIdleWakeUs : 100000);
    c->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (c->sense.load(std::memory_order_acquire) == sense_) return Status::OK();
    Status s = AfterWait();
    if (!s.ok()) return s;
  }
}

Status ShmCollectives::AfterWait() {
  EscapeIfPeersLost();  // a caller's cycle: its peer here may wait on a lost one for good
  if (idle_) {
    Status s = idle_();
    if (!s.ok()) return s;
  }
  int dead = DeadPeer();  // woken by the timeout (or a signal): is everyone still there?
  if (dead < 0) return Status::OK();
  char host[256] = "";
  gethostname(host, sizeof(host) - 1);
  return Status(HVDLITE_ERR_RANK_FAILED, "rank " + std::to_string(global_ranks_[dead]) + " on host " +
                                             host + " (pid " + std::to_string(pids_[dead]) +
                                             ") ended during a shared-memory collective");
}

Status ShmCollectives::AndBits(uint64_t* bits, int64_t words, int64_t tag, int64_t bytes) {
  poll_ = may_poll_;
  std::memcpy(Bits(rank_, bits_set_), bits, words * sizeof(uint64_t));
  int64_t* head = CompanionHead(rank_, bits_set_);
  head[0] = tag;
  head[1] = tag < 0 ? 0 : bytes;
  Status s = Meet();
  if (!s.ok()) return s;
  for (int k = 0; k < size_; ++k) {
    if (k == rank_) continue;
    const uint64_t* theirs = Bits(k, bits_set_);
    for (int64_t i = 0; i < words; ++i) bits[i] &= theirs[i];
  }
  bits_set_ ^= 1;
  return Status::OK();
}

namespace {

// Calls fn(piece, first element in the piece, first element in the flat buffer, count)
// for each piece overlapping the flat range [lo, hi); starts[i] is piece i's first flat
// element (and starts.back() the total).
template <typename Fn>
void ForEachPiece(const std::vector<ShmCollectives::Piece>& pieces, const std::vector<int64_t>& starts,
                  int64_t lo, int64_t hi, Fn fn) {
  size_t i = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
  for (; lo < hi && i < pieces.size(); ++i) {
    int64_t end = std::min(hi, starts[i + 1]);
    if (end > lo) fn(pieces[i], lo - starts[i], lo, end - lo);
    lo = std::max(lo, end);
  }
}

// starts[i]: piece i's first element in the flat buffer; starts.back(): the total.
std::vector<int64_t> PieceStarts(const std::vector<ShmCollectives::Piece>& pieces) {
  std::vector<int64_t> starts(1, 0);
  for (const ShmCollectives::Piece& p : pieces) starts.push_back(starts.back() + p.count);
  return starts;
}

// Elements per 64 bytes (at least 1): parts and shards start on such boundaries, for the
// vectorized loops.
int64_t AlignOf(int64_t elem) { return std::max<int64_t>(1, 64 / elem); }

// The piece that holds all of the flat range [lo, hi) (not empty), or -1.
int64_t PieceHolding(const std::vector<ShmCollectives::Piece>& pieces, const std::vector<int64_t>& starts,
                     int64_t lo, int64_t hi) {
  const size_t i = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
  return hi > lo && i < pieces.size() && hi <= starts[i + 1] ? static_cast<int64_t>(i) : -1;
}

}  // namespace

Status ShmCollectives::Allreduce(const std::vector<Piece>& pieces, const AllreduceOptions& options) {
  const int32_t dtype = options.dtype, reduce_op = options.reduce_op;
  const double prescale = options.prescale, postscale = options.postscale;
  const int64_t divisor = options.divisor;
  const int64_t elem = ElementSize(dtype);
  const int64_t per_chunk = chunk_bytes_ / elem;
  const int64_t align = AlignOf(elem);
  const std::vector<int64_t> starts = PieceStarts(pieces);
  const int64_t count = starts.back();
  poll_ = may_poll_ && count * elem <= kPollMaxBytes;
  const int64_t chunks = (count + per_chunk - 1) / per_chunk;
  const bool float_sum = size_ >= 2 && reduce_op == HVDLITE_SUM &&
                         (dtype == HVDLITE_FLOAT32 || dtype == HVDLITE_FLOAT64);

  // Chunk c: flat elements [done, done + n), rank k's part [k * part, (k + 1) * part)
  // of it (clipped to n), its slot set, and where the reduction reads this rank's own
  // part: straight from the tensor when that part lies in one tensor and needs no
  // prescaling (no other rank reads it, so it is not copied in: half of the copying,
  // with 2 ranks), else from the in slot.
  struct Chunk {
    int64_t done, n, part, lo, hi;
    int set;
    const uint8_t* own_in_tensor;  // null: read from the in slot
    // Float Sum and Average: where this rank's part lies in one output tensor, the
    // reduction writes it there as well as to the out slot, and copy-out skips it.
    uint8_t* own_out_tensor;
  };
  auto chunk = [&](int64_t c) {
    Chunk k;
    k.done = c * per_chunk;
    k.n = std::min(per_chunk, count - k.done);
    k.part = ((k.n + size_ - 1) / size_ + align - 1) / align * align;
    k.lo = std::min(k.n, k.part * rank_);
    k.hi = std::min(k.n, k.lo + k.part);
    k.set = static_cast<int>((issued_ + c) % 2);
    // Piece i holds all of this rank's part, from its element `at` on, when in_one.
    const int64_t i = PieceHolding(pieces, starts, k.done + k.lo, k.done + k.hi);
    const bool in_one = i >= 0;
    const int64_t at = in_one ? k.done + k.lo - starts[i] : 0;
    k.own_in_tensor = in_one && prescale == 1.0 && pieces[i].in
                          ? static_cast<const uint8_t*>(pieces[i].in) + at * elem : nullptr;
    k.own_out_tensor = in_one && float_sum && pieces[i].out
                           ? static_cast<uint8_t*>(pieces[i].out) + at * elem : nullptr;
    return k;
  };
  auto copy_in = [&](const Chunk& k) {
    uint8_t* slot = In(rank_, k.set);
    auto copy = [&](int64_t from, int64_t to) {
      ForEachPiece(pieces, starts, k.done + from, k.done + to, [&](const Piece& p, int64_t at, int64_t flat, int64_t len) {
        uint8_t* dst = slot + (flat - k.done) * elem;
        if (p.in) {
          ScaledCopy(dst, static_cast<const uint8_t*>(p.in) + at * elem, len, dtype, prescale, 1);
        } else {
          std::memset(dst, 0, len * elem);
        }
      });
    };
    if (k.own_in_tensor) {
      copy(0, k.lo);
      copy(k.hi, k.n);
    } else {
      copy(0, k.n);
    }
  };
  std::vector<const uint8_t*> parts(size_);
  auto reduce = [&](const Chunk& k) {
    if (k.hi <= k.lo) return;
    for (int r = 0; r < size_; ++r) parts[r] = In(r, k.set) + k.lo * elem;
    if (k.own_in_tensor) parts[rank_] = k.own_in_tensor;
    uint8_t* out = Out(rank_, k.set) + k.lo * elem;
    if (k.own_out_tensor) {
      // ScaledCopy's factor; multiplying by exactly 1 would change nothing, so skipped.
      const double scale = postscale / static_cast<double>(divisor);
      if (dtype == HVDLITE_FLOAT32) {
        SumScaledInto(reinterpret_cast<float*>(out), reinterpret_cast<float*>(k.own_out_tensor), parts,
                      k.hi - k.lo, static_cast<float>(scale));
      } else {
        SumScaledInto(reinterpret_cast<double*>(out), reinterpret_cast<double*>(k.own_out_tensor), parts,
                      k.hi - k.lo, scale);
      }
      return;
    }
    ReduceElements(out, parts, k.hi - k.lo, dtype, reduce_op);
    // Scaled here, once, while the part is in this core's cache: every rank then copies
    // it out with a plain memcpy, which writes whole cache lines without reading them
    // first (a scaling loop into the outputs ran ~3x slower than memcpy).
    ScaledCopy(out, out, k.hi - k.lo, dtype, postscale, divisor);
  };
  auto copy_out = [&](const Chunk& k) {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ && k.own_out_tensor) continue;
      const int64_t rlo = std::min(k.n, k.part * r), rhi = std::min(k.n, rlo + k.part);
      const uint8_t* from = Out(r, k.set);
      ForEachPiece(pieces, starts, k.done + rlo, k.done + rhi, [&](const Piece& p, int64_t at, int64_t flat, int64_t len) {
        if (p.out) std::memcpy(static_cast<uint8_t*>(p.out) + at * elem, from + (flat - k.done) * elem, len * elem);
      });
    }
  };
  if (chunks == 0) return Status::OK();
  // Chunk c is chunk g = issued_ + c of every call so far. Each step waits only for
  // what it reads or overwrites, from the peers' previous steps: a peer up to a chunk
  // behind costs no wait, and a wait sleeps on that peer's progress futex.
  //   copy in c + 1: chunk c - 1 (same slot set) reduced everywhere;
  //   reduce c: chunk c copied in everywhere, chunk c - 2 copied out everywhere;
  //   copy out c - 1: chunk c - 1 reduced everywhere.
  // (Counts are of chunks done: chunk g reduced is reduced >= g + 1.)
  const int64_t g0 = issued_;
  // The first copy-in waits as the later ones do: after Rounds, a peer may still be
  // draining the step before last, in this slot set.
  Status s = WaitFor(1, g0 - 1);
  if (!s.ok()) return s;
  copy_in(chunk(0));
  Publish(0, g0 + 1);
  for (int64_t c = 0; c <= chunks; ++c) {
    const int64_t g = g0 + c;
    if (c + 1 < chunks) {
      if (!(s = WaitFor(1, g)).ok()) return s;
      copy_in(chunk(c + 1));
      Publish(0, g + 2);
    }
    if (c < chunks) {
      if (!(s = WaitFor(0, g + 1)).ok() || !(s = WaitFor(2, g - 1)).ok()) return s;
      reduce(chunk(c));
      Publish(1, g + 1);
    }
    if (c > 0) {
      if (!(s = WaitFor(1, g)).ok()) return s;
      copy_out(chunk(c - 1));
      Publish(2, g);
    }
  }
  issued_ = g0 + chunks;
  return Status::OK();
}

namespace {

// Round r of a shard walk: rank k's shard elements [lo(k, r), hi(k, r)), flat from the
// block's first, which sit at k * step elements into a slot area (ReduceScatter) or at
// its start (Allgather: every rank's area holds its own shard only).
struct ShardRounds {
  ShardRounds(const std::vector<int64_t>& bounds, int64_t step) : bounds(bounds), step(step) {
    int64_t longest = 0;
    for (size_t k = 0; k + 1 < bounds.size(); ++k) longest = std::max(longest, bounds[k + 1] - bounds[k]);
    rounds = (longest + step - 1) / step;
  }
  int64_t lo(int k, int64_t r) const { return std::min(bounds[k] + r * step, bounds[k + 1]); }
  int64_t hi(int k, int64_t r) const { return std::min(bounds[k + 1], bounds[k] + (r + 1) * step); }
  const std::vector<int64_t>& bounds;
  int64_t step, rounds;
};

}  // namespace

std::vector<int64_t> ShmCollectives::EvenShards(int64_t count, int32_t dtype) const {
  const int64_t align = AlignOf(ElementSize(dtype));
  const int64_t shard = ((count + size_ - 1) / size_ + align - 1) / align * align;
  std::vector<int64_t> bounds(size_ + 1);
  for (int k = 0; k <= size_; ++k) bounds[k] = std::min(count, shard * k);
  return bounds;
}

Status ShmCollectives::ReduceScatter(const std::vector<Piece>& pieces, int64_t first,
                                   const std::vector<int64_t>& bounds, int32_t dtype, int32_t reduce_op,
                                   double prescale, void* shard) {
  poll_ = may_poll_ && bounds.back() * ElementSize(dtype) <= kPollMaxBytes;
  const int64_t elem = ElementSize(dtype), align = AlignOf(elem);
  const std::vector<int64_t> starts = PieceStarts(pieces);
  // Every shard's part of a round side by side in one area, each on a 64-byte boundary.
  const ShardRounds walk(bounds, std::max<int64_t>(1, kAreaBytes / elem / size_ / align * align));
  // This rank's own part of round r straight from its tensor, when it lies in one and
  // needs no prescaling: no peer reads it, so it is not copied in (as in Allreduce).
  auto own_in_tensor = [&](int64_t r) -> const uint8_t* {
    if (prescale != 1.0) return nullptr;
    const int64_t lo = first + walk.lo(rank_, r);
    const int64_t i = PieceHolding(pieces, starts, lo, first + walk.hi(rank_, r));
    if (i < 0 || !pieces[i].in) return nullptr;
    return static_cast<const uint8_t*>(pieces[i].in) + (lo - starts[i]) * elem;
  };
  // Every shard's part of round r into this rank's area.
  auto copy_in = [&](int64_t r, int set) {
    uint8_t* area = Area(rank_, set);
    for (int k = 0; k < size_; ++k) {
      if (k == rank_ && own_in_tensor(r)) continue;
      const int64_t lo = first + walk.lo(k, r);
      uint8_t* part = area + k * walk.step * elem;
      ForEachPiece(pieces, starts, lo, first + walk.hi(k, r), [&](const Piece& p, int64_t at, int64_t flat, int64_t len) {
        uint8_t* dst = part + (flat - lo) * elem;
        if (p.in) {
          ScaledCopy(dst, static_cast<const uint8_t*>(p.in) + at * elem, len, dtype, prescale, 1);
        } else {
          std::memset(dst, 0, len * elem);
        }
      });
    }
  };
  std::vector<const uint8_t*> parts(size_);
  // This rank's part of round r, from every rank's area in rank order, into its shard.
  auto reduce = [&](int64_t r, int set) {
    const int64_t n = walk.hi(rank_, r) - walk.lo(rank_, r);
    if (n <= 0) return;
    for (int k = 0; k < size_; ++k) parts[k] = Area(k, set) + rank_ * walk.step * elem;
    if (const uint8_t* own = own_in_tensor(r)) parts[rank_] = own;
    ReduceElements(static_cast<uint8_t*>(shard) + r * walk.step * elem, parts, n, dtype, reduce_op);
  };
  return Rounds(walk.rounds, copy_in, reduce);
}

Status ShmCollectives::Rounds(int64_t rounds, const std::function<void(int64_t, int)>& fill,
                            const std::function<void(int64_t, int)>& drain) {
  // Each step waits only for what it overwrites or reads (counts are of steps done):
  //   fill g: step g - 2 (same slot set: an Allreduce chunk or a round) drained everywhere;
  //   drain g - 1: step g - 1 filled everywhere.
  // A round drained counts as reduced too, so that the next Allreduce's waits hold.
  const int64_t g0 = issued_;
  Status s;
  for (int64_t r = 0; r <= rounds && rounds > 0; ++r) {
    const int64_t g = g0 + r;
    if (r < rounds) {
      if (!(s = WaitFor(2, g - 1)).ok()) return s;
      fill(r, static_cast<int>(g % 2));
      Publish(0, g + 1);
    }
    if (r > 0) {
      if (!(s = WaitFor(0, g)).ok()) return s;
      drain(r - 1, static_cast<int>((g - 1) % 2));
      Publish(1, g);
      Publish(2, g);
    }
    if (idle_ && !(s = idle_()).ok()) return s;
  }
  issued_ = g0 + rounds;
  return Status::OK();
}

Status ShmCollectives::Allgather(const void* shard, const std::vector<Piece>& pieces, int64_t first,
                               const std::vector<int64_t>& bounds, int32_t dtype, double postscale,
                               int64_t divisor) {
  const int64_t elem = ElementSize(dtype);
  poll_ = may_poll_ && bounds.back() * elem <= kPollMaxBytes;
  const std::vector<int64_t> starts = PieceStarts(pieces);
  // Each rank's area holds its own shard's part only: a whole area per round.
  const ShardRounds walk(bounds, std::max<int64_t>(1, kAreaBytes / elem));
  // This rank's part of round r into its area.
  auto publish = [&](int64_t r, int set) {
    const int64_t n = walk.hi(rank_, r) - walk.lo(rank_, r);
    if (n > 0) std::memcpy(Area(rank_, set), static_cast<const uint8_t*>(shard) + r * walk.step * elem, n * elem);
  };
  // Every rank's part of round r into the outputs (this rank's own from its shard).
  auto copy_out = [&](int64_t r, int set) {
    for (int k = 0; k < size_; ++k) {
      const int64_t lo = first + walk.lo(k, r);
      const uint8_t* from = k == rank_ ? static_cast<const uint8_t*>(shard) + r * walk.step * elem : Area(k, set);
      ForEachPiece(pieces, starts, lo, first + walk.hi(k, r), [&](const Piece& p, int64_t at, int64_t flat, int64_t len) {
        if (p.out) {
          ScaledCopy(static_cast<uint8_t*>(p.out) + at * elem, from + (flat - lo) * elem, len, dtype,
                     postscale, divisor);
        }
      });
    }
  };
  return Rounds(walk.rounds, publish, copy_out);
}

Status ShmCollectives::Broadcast(const void* in, void* out, int64_t nbytes, int root) {
  std::vector<int64_t> bounds(size_ + 1, 0);
  for (int k = root + 1; k <= size_; ++k) bounds[k] = nbytes;
  // The root's shard is its input; its output is filled from it (no copy where in
  // place) as each round is drained, while the others copy the same round out of its
  // area.
  return Allgather(in, {{nullptr, out, nbytes}}, 0, bounds, HVDLITE_UINT8, 1.0, 1);
}

Status ShmCollectives::Alltoall(const void* in, const std::vector<int64_t>& bytes, void* out) {
  // Of rank j's row: its whole length, and where and how long its block for this rank is;
  // where that block goes in out.
  std::vector<int64_t> total(size_, 0), from(size_, 0), len(size_, 0), at(size_, 0);
  int64_t most = 0, placed = 0;
  for (int j = 0; j < size_; ++j) {
    for (int k = 0; k < size_; ++k) {
      const int64_t b = bytes[static_cast<size_t>(j) * size_ + k];
      if (k < rank_) from[j] += b;
      total[j] += b;
    }
    len[j] = bytes[static_cast<size_t>(j) * size_ + rank_];
    at[j] = placed;
    placed += len[j];
    most = std::max(most, total[j]);
  }
  poll_ = may_poll_ && most <= kPollMaxBytes;
  const int64_t step = kAreaBytes;
  const auto* mine = static_cast<const uint8_t*>(in);
  // Round r of this rank's row into its area, less its own block (take reads that
  // from in).
  const int64_t own_lo = from[rank_], own_hi = from[rank_] + len[rank_];
  auto publish = [&](int64_t r, int set) {
    const int64_t lo = r * step, hi = std::min(total[rank_], lo + step);
    const auto copy = [&](int64_t a, int64_t b) {
      if (a < b) std::memcpy(Area(rank_, set) + (a - lo), mine + a, b - a);
    };
    copy(lo, std::min(hi, own_lo));
    copy(std::max(lo, own_hi), hi);
  };
  auto take = [&](int64_t r, int set) {
    const int64_t lo = r * step, hi = lo + step;
    for (int j = 0; j < size_; ++j) {
      const int64_t a = std::max(lo, from[j]), b = std::min(hi, from[j] + len[j]);
      if (a >= b) continue;
      const uint8_t* src = j == rank_ ? mine + a : Area(j, set) + (a - lo);
      std::memcpy(static_cast<uint8_t*>(out) + at[j] + (a - from[j]), src, b - a);
    }
  };
  return Rounds((most + step - 1) / step, publish, take);
}

}  // namespace hvdlite
