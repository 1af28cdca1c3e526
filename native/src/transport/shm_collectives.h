// Collectives among ranks that share one machine, through memory they all map: the
// allreduce described below, the reduce-scatter and allgather halves of the
// hierarchical allreduce, the bit-AND of the coordination round (over a barrier of its own).
//
// The allreduce:
//
// Each rank owns one segment of shared memory (the MPI backend allocates the segments
// and hands their addresses over; this file knows nothing of MPI). The tensors of one
// (fused) allreduce are taken as one flat buffer, which goes through in chunks of
// kChunkBytes. Chunk k takes three steps:
//
//   1. every rank copies its chunk, straight from its tensors and prescaled, into its
//      own "in" slot (all but its own part, when the reduction can read that part
//      from the tensor itself);
//   2. rank r reduces the r-th part of the chunk, reading every rank's in slot in rank
//      order, into the same part of its own "out" slot, and postscales it there (and
//      divides it, for Average) while it is in cache; a float Sum or Average does
//      that in one pass that also writes the part into r's own output tensor;
//   3. every rank copies each part (but its own, where step 2 wrote it) from its
//      owner's out slot into its tensors' outputs, with memcpy.
//
// So there is no fusion buffer: packing, unpacking and scaling ride on the copies that
// move data in and out of shared memory anyway.
//
// Every element is reduced once, by one rank, in rank order, and copied to all: the
// result is bit-identical on every rank. Against MPICH's shared-memory allreduce this
// moves less data (one copy in, one reduction pass, one copy out) and waits without
// a blocked peer spinning on a core.
//
// The steps are pipelined without a barrier: each rank publishes, in its own segment,
// how many chunks (counted over every call) it has copied in, reduced and copied out,
// and before a step waits only for what that step reads or overwrites. Two sets of
// slots alternate from chunk to chunk, so a rank copies chunk k+1 in once every rank
// has reduced chunk k-1 (the last reader of that in slot), reduces chunk k once every
// rank has copied it in and copied chunk k-2 out (the last readers of that out slot),
// then copies chunk k-1 out once every rank has reduced it. Each wait is for a peer's
// previous step, so a peer up to a chunk behind costs no wait at all; a rank that does
// wait sleeps on the peer's progress futex and is woken when the peer publishes. (With
// one barrier per chunk, every chunk cost a sleep and a wake-up on one rank or the
// other: 33 of them for a 16 MB gradient, which took twice its CPU time.)
//
// ReduceScatter and Allgather go round by round, counted in the same sequence as
// Allreduce's chunks and pipelined the same way, without a barrier: a rank fills round
// r + 1 while its peers may still drain round r, and waits only for what it reads or
// overwrites. (With a barrier per round, each round waited for whichever rank had no
// core, with more ranks than cores: a 64 MiB-per-rank allgather at 3 ranks on 2 cores
// took 450 ms, against 330 pipelined, median of two runs each.) Their rounds use a slot set's in
// and out slots as one area (2 * kChunkBytes): ReduceScatter's holds a part of every
// shard, reduced straight into the caller's shard; Allgather's holds this rank's own
// part only, so one round moves 1 MiB of every rank's shard.
//
// The barrier (a counter and a sense flag in rank 0's segment) does not spin: a rank
// that arrives before its peers sleeps on the sense flag as a futex until the last
// rank to arrive wakes it. A waiting rank takes no CPU from the training threads that
// share its cores (a 20 us spin per chunk cost each rank ~0.7 ms of CPU per step of
// the MLP benchmark's 23 MB), and a wake (the background thread asks for the kernel's
// shortest slice, so it takes the core from a training thread at once) costs a few
// microseconds, not a timer's late tens. Every 100 ms of waiting it checks that the
// peer processes still exist, so a dead rank ends the wait with an error that names it
// rather than a hang.
//
// The same segments carry the coordination's bit vector (AndBits): every rank writes
// its vector to its segment, passes the barrier and ANDs all of them. A rank that gets
// there before a peer sleeps until the peer arrives and is woken at once, where the
// MPI collective could only be polled (with a backoff whose sleeps a peer's arrival
// does not cut short). Two areas alternate, as the slots do: an area is written again
// two calls later, after a barrier every rank passed once done reading it.
//
// Beside each bit-vector area, a companion area carries a small op's data with the
// vector (ProcessSetState's carried op: the data of a cached op that is its rank's only
// one, which every rank reads after the AND, so that the op takes no meeting of its
// own). It is written before the barrier and alternates with the bit-vector areas, so a
// rank reads its peers' companions until its next AndBits.
//
// The cycle's thread only (core/loop.cc: the background thread, or a caller's cycle).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "common/allreduce_options.h"
#include "common/common.h"
#include "common/elementwise.h"

namespace hvdlite {

class ShmCollectives {
 public:
  // Bytes per chunk and per rank: two sets of in and out slots of this size.
  static constexpr int64_t kChunkBytes = 1 << 19;
  // Longest bit vector AndBits takes (a response cache of up to ~65,000 entries).
  static constexpr int64_t kMaxBitsWords = 2048;
  // Each segment: the barrier's control block (used in rank 0's), two bit-vector
  // areas, two companion areas, then the two sets of in and out slots.
  static constexpr int64_t kControlBytes = 4096;
  // Data carried with the bit vector (a companion), per rank: at most this many bytes
  // (the C API's, which the object collectives read).
  static constexpr int64_t kCompanionBytes = HVDLITE_CARRIED_MAX_BYTES;
  // Each companion area: its tag and length (64 bytes, for alignment), then the data;
  // padded so that the slots after the header start on a page, as they did without.
  static constexpr int64_t kCompanionArea = 20 * 1024;
  static_assert(kCompanionArea >= 64 + kCompanionBytes, "a companion fits its area");
  static constexpr int64_t kHeaderBytes = kControlBytes + 2 * kMaxBitsWords * 8 + 2 * kCompanionArea;
  static_assert(kHeaderBytes % 4096 == 0, "the slots start on a page");
  static constexpr int64_t kSegmentBytes = kHeaderBytes + 4 * kChunkBytes;

  // segments[k]: rank k's segment as mapped in this process (each one's control area
  // zeroed by its owner before any rank uses it); pids[k]: rank k's process id;
  // global_ranks[k]: its rank in the job, which an error about it names (with this
  // host's name).
  ShmCollectives(int rank, std::vector<uint8_t*> segments, std::vector<int64_t> pids,
                 std::vector<int> global_ranks);

  // One tensor of an allreduce: count elements read from in (null: zeros, from a rank
  // that joined) and written to out (null: dropped; in == out reduces in place). An out
  // must not overlap another piece's in.
  struct Piece {
    const void* in;
    void* out;
    int64_t count;
  };
  // Reduces the pieces over the ranks as one buffer, as options say. Every rank calls
  // it with the same counts and options, in the same order.
  Status Allreduce(const std::vector<Piece>& pieces, const AllreduceOptions& options);

  // Reduce-scatter and allgather over the flat elements [first, first + bounds.back())
  // of the pieces, rank k's shard being [first + bounds[k], first + bounds[k + 1])
  // (bounds: size + 1 offsets, bounds[0] == 0, nondecreasing: any split, shards of no
  // elements included). They serve both the halves of a hierarchical allreduce
  // (HierarchicalAllreduce, over EvenShards) and the reducescatter and allgather of
  // ranks on one host (MpiBackend, over the caller's split). Each round moves up to a
  // step of every shard through the slots, pipelined (Rounds).
  //
  // EvenShards(count, dtype): count elements cut into one contiguous shard per rank,
  // each starting on a 64-byte boundary (the vectorized loops), as Allreduce's parts.
  std::vector<int64_t> EvenShards(int64_t count, int32_t dtype) const;
  // shard = reduce over ranks of (the block of the pieces' ins * prescale), this rank's
  // shard only, each element reduced once, in rank order (as Allreduce). Every rank
  // calls it with the same pieces' counts, first, bounds, dtype and op. shard must not
  // overlap the pieces' ins.
  Status ReduceScatter(const std::vector<Piece>& pieces, int64_t first, const std::vector<int64_t>& bounds,
                       int32_t dtype, int32_t reduce_op, double prescale, void* shard);
  // The block of the pieces' outs = every rank's shard * postscale / divisor.
  Status Allgather(const void* shard, const std::vector<Piece>& pieces, int64_t first,
                   const std::vector<int64_t>& bounds, int32_t dtype, double postscale, int64_t divisor);
  // Rank root's in (nbytes) into every rank's out: an Allgather in which only root's
  // shard has bytes. Where the root's out is not its in, the root fills it round by
  // round beside the others' copies (in == out: in place; the other ranks' in is unused).
  Status Broadcast(const void* in, void* out, int64_t nbytes, int root);
  // Every rank's bytes for every other: bytes[j * size + k] is what rank j sends rank k
  // (the same matrix on every rank); in holds this rank's row, blocks in rank order, and
  // out receives one block from each rank, in rank order. Each round, every rank
  // publishes the next kAreaBytes of its in (less its own block, which it reads from
  // in); each takes its blocks' parts from there.
  Status Alltoall(const void* in, const std::vector<int64_t>& bytes, void* out);
  // Called between the rounds of ReduceScatter and Allgather, and every kIdleWakeUs
  // while a wait sleeps (instead of every 100 ms), while set: the hierarchical
  // allreduce moves its network step on there. An error ends the call with it.
  void SetIdle(std::function<Status()> idle) { idle_ = std::move(idle); }
  // The chunk Allreduce moves per step of its pipeline (autotune.h), at most
  // kChunkBytes, which sizes the slots. Every rank sets the same before the same call.
  void set_chunk_bytes(int64_t bytes) { chunk_bytes_ = std::max<int64_t>(4096, std::min(bytes, kChunkBytes)); }

  // Whether a framework thread of this process waits for a blocking op's result now (the
  // core says so every cycle): then the waits of the coordination round and of
  // collectives of at most kPollMaxBytes poll a little before they sleep (poll_).
  // The caller (MpiBackend) says no where this host has more ranks than cores: a poll
  // would keep the core from the peer it waits for.
  void set_waits_may_poll(bool may) { may_poll_ = may; }

  // bits[i] = AND over ranks of every rank's bits[i]; words <= kMaxBitsWords. Every
  // rank calls it with the same length, in the same order relative to Allreduce.
  // tag: this rank's companion (-1: none), whose `bytes` (<= kCompanionBytes) it wrote
  // to Companion() before the call.
  Status AndBits(uint64_t* bits, int64_t words, int64_t tag = -1, int64_t bytes = 0);
  // Where this rank writes the companion of its next AndBits.
  uint8_t* Companion() const;
  // Rank k's companion in the last AndBits: its tag (-1: none), *data and *bytes. Valid
  // until this rank's next AndBits.
  int64_t PeerCompanion(int k, const uint8_t** data, int64_t* bytes) const;

  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  uint64_t* Bits(int rank, int set) const;
  // Rank `rank`'s companion area `set`: [tag, bytes] then the data at +64.
  int64_t* CompanionHead(int rank, int set) const;
  uint8_t* In(int rank, int set) const;
  uint8_t* Out(int rank, int set) const;
  // A set's in and out slots as one area of kAreaBytes (ReduceScatter and Allgather).
  static constexpr int64_t kAreaBytes = 2 * kChunkBytes;
  uint8_t* Area(int rank, int set) const { return In(rank, set); }
  // The rounds of ReduceScatter and Allgather, pipelined as Allreduce's chunks are and
  // counted with them: round r is step g = issued_ + r, in slot set g % 2. fill(r, set)
  // writes this rank's area once every peer has drained round r - 2 (the last reader of
  // that set); drain(r, set) reads the peers' areas once every peer has filled round r.
  Status Rounds(int64_t rounds, const std::function<void(int64_t, int)>& fill,
                const std::function<void(int64_t, int)>& drain);
  // The barrier AndBits passes: every rank arrives before any leaves; a rank that
  // waits sleeps (after polling, where poll_ says).
  Status Meet();
  // Allreduce's progress: field 0 copied in, 1 reduced, 2 copied out (Rounds: 0 filled,
  // 1 and 2 drained). Publish sets this
  // rank's count (in chunks over all calls) and wakes peers that wait for it; WaitFor
  // sleeps until every peer's count is at least `chunks`.
  void Publish(int field, int64_t chunks);
  Status WaitFor(int field, int64_t chunks);
  // How often a sleeping barrier wakes to call idle_: a ring step that ends while the
  // host waits is noticed within this, and the next one posted.
  static constexpr int64_t kIdleWakeUs = 200;
  // The first rank whose process has ended, or -1.
  int DeadPeer() const;
  // After a futex wait that did not end the wait (a timeout, a signal): calls idle_ and
  // returns an error naming a peer whose process has ended.
  Status AfterWait();

  const int rank_, size_;
  const std::vector<uint8_t*> segments_;
  const std::vector<int64_t> pids_;
  const std::vector<int> global_ranks_;
  int64_t issued_ = 0;  // Allreduce chunks and rounds of every call so far (step g uses slot set g % 2)
  int bits_set_ = 0;  // bit-vector area of the next AndBits
  // Whether this call's waits poll for up to ~50 us before they sleep (PollUntil in the
  // .cc): only while a thread of this process waits for a blocking op (set_waits_may_poll),
  // in AndBits and in collectives of at most kPollMaxBytes, whose steps a peer in step
  // finishes within microseconds. Otherwise a wait sleeps at once: the framework's
  // threads are computing (a training step's backward; and while one rank's optimizer
  // waits in synchronize, the other rank's backward may still run: polling for any
  // waiting thread cost the MLP step 6-10% on 2 cores), and a larger collective's peers
  // need the cores for copying and reducing (a 20 us poll per chunk cost each rank
  // ~0.7 ms of CPU per MLP step). Up to 1 MiB, where a blocking caller runs the cycle
  // itself (MpiBackend::CallerCycleBytes), a step's sleep and wake-up were a third of
  // the call or more; the MLP step, whose large buckets no caller waits on, measured
  // the same (benchmarks/compare_trees.py, 6 rounds).
  bool may_poll_ = false;
  bool poll_ = false;
  static constexpr int64_t kPollMaxBytes = 1024 * 1024;
  int sense_ = 0;  // this rank's barrier sense
  int64_t chunk_bytes_ = kChunkBytes;
  std::function<Status()> idle_;
};

}  // namespace hvdlite
