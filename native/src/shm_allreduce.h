// Allreduce among ranks that share one machine, through memory they all map.
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
//      order, into the same part of its own "out" slot;
//   3. every rank copies each part from its owner's out slot into its tensors'
//      outputs, postscaled (and divided, for Average) on the way.
//
// So there is no fusion buffer: packing, unpacking and scaling ride on the copies that
// move data in and out of shared memory anyway.
//
// Every element is reduced once, by one rank, in rank order, and copied to all: the
// result is bit-identical on every rank. Against MPICH's shared-memory allreduce this
// moves less data (one copy in, one reduction pass, one copy out) and waits without
// a blocked peer spinning on a core.
//
// The steps are pipelined over one barrier per chunk: after barrier k every rank has
// copied chunk k in and reduced chunk k-1, so a rank reduces chunk k, copies chunk k-1
// out and copies chunk k+1 in before the next. Two sets of slots alternate from chunk
// to chunk (across calls too): chunk k+1's in slot was last read by the reduction of
// chunk k-1, and chunk k's out slot by the copying out of chunk k-2, both finished by
// every rank before barrier k. A call of n chunks passes n+1 barriers (two per chunk
// without the pipeline), and each rank has a chunk's worth of copying to do between
// them, which evens out a peer's late arrival.
//
// The barrier (a counter and a sense flag in rank 0's segment) spins for a while (20 us
// between chunks, where a peer in step is there at once; 50 us in the coordination,
// where ranks arrive as their own threads submit), then sleeps on the sense flag as a
// futex until the last rank to arrive wakes it: a waiting rank takes no CPU from the training threads that share
// its cores (spinning or yielding there took up to half a core from them), and a wake
// costs a few microseconds, not a timer's late tens. Every 100 ms of waiting it checks
// that the peer processes still exist, so a dead rank ends the wait with an error that
// names it rather than a hang.
//
// The same segments carry the coordination's bit vector (AndBits): every rank writes
// its vector to its segment, passes the barrier and ANDs all of them. A rank that gets
// there before a peer sleeps until the peer arrives and is woken at once, where the
// MPI collective could only be polled (with a backoff whose sleeps a peer's arrival
// does not cut short). Two areas alternate, as the slots do: an area is written again
// two calls later, after a barrier every rank passed once done reading it.
//
// Background thread only.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "common.h"

namespace hvdlite {

// out = parts[0] op parts[1] op ... element by element, in that order (Average: Sum;
// 16-bit floats accumulate in float and round once). out may be parts[0]; no other
// part may overlap it.
void ReduceElements(void* out, const std::vector<const uint8_t*>& parts, int64_t n, int32_t dtype,
                    int32_t reduce_op);

class ShmAllreduce {
 public:
  // Bytes per chunk and per rank: two sets of in and out slots of this size.
  static constexpr int64_t kChunkBytes = 1 << 19;
  // Longest bit vector AndBits takes (a response cache of up to ~65,000 entries).
  static constexpr int64_t kMaxBitsWords = 2048;
  // Each segment: the barrier's control block (used in rank 0's), two bit-vector
  // areas, then the two sets of in and out slots.
  static constexpr int64_t kControlBytes = 4096;
  static constexpr int64_t kHeaderBytes = kControlBytes + 2 * kMaxBitsWords * 8;
  static constexpr int64_t kSegmentBytes = kHeaderBytes + 4 * kChunkBytes;

  // segments[k]: rank k's segment as mapped in this process (rank 0's zeroed by its
  // owner before any rank uses it); pids[k]: rank k's process id.
  ShmAllreduce(int rank, std::vector<uint8_t*> segments, std::vector<int64_t> pids);

  // One tensor of an allreduce: count elements read from in (null: zeros, from a rank
  // that joined) and written to out (null: dropped; in == out reduces in place). An out
  // must not overlap another piece's in.
  struct Piece {
    const void* in;
    void* out;
    int64_t count;
  };
  // Reduces the pieces over the ranks as one buffer: out = reduce(in * prescale) *
  // postscale / divisor, with ScaledCopy's rules. Every rank calls it with the same
  // counts, dtype, op and scaling, in the same order.
  Status Allreduce(const std::vector<Piece>& pieces, int32_t dtype, int32_t reduce_op,
                   double prescale, double postscale, int64_t divisor);

  // The two halves of a hierarchical allreduce (HierarchicalAllreduce), over the flat
  // elements [first, first + count) of the pieces: that block is cut into one
  // contiguous shard per rank, rank k's being [ShardBegin(count, dtype, k),
  // ShardBegin(count, dtype, k + 1)) of it. Each round moves a chunk's worth of every
  // shard through the slots, 1/size of the in (or out) slot per shard, over one barrier
  // per round, pipelined like Allreduce.
  int64_t ShardBegin(int64_t count, int32_t dtype, int rank) const;
  // shard = reduce over ranks of (the block of the pieces' ins * prescale), this rank's
  // shard only. Every rank calls it with the same pieces' counts, block, dtype and op.
  Status ReduceScatter(const std::vector<Piece>& pieces, int64_t first, int64_t count,
                       int32_t dtype, int32_t reduce_op, double prescale, void* shard);
  // The block of the pieces' outs = every rank's shard * postscale / divisor.
  Status Allgather(const void* shard, const std::vector<Piece>& pieces, int64_t first,
                   int64_t count, int32_t dtype, double postscale, int64_t divisor);
  // Called between the rounds of ReduceScatter and Allgather, and every kIdleWakeUs
  // while a barrier sleeps (instead of every 100 ms), while set: the hierarchical
  // allreduce moves its network step on there. An error ends the call with it.
  void SetIdle(std::function<Status()> idle) { idle_ = std::move(idle); }
  // The chunk Allreduce moves per barrier (autotune.h), at most kChunkBytes, which
  // sizes the slots. Every rank sets the same before the same call.
  void set_chunk_bytes(int64_t bytes) { chunk_bytes_ = std::max<int64_t>(4096, std::min(bytes, kChunkBytes)); }

  // bits[i] = AND over ranks of every rank's bits[i]; words <= kMaxBitsWords. Every
  // rank calls it with the same length, in the same order relative to Allreduce.
  Status AndBits(uint64_t* bits, int64_t words);

 private:
  uint64_t* Bits(int rank, int set) const;
  uint8_t* In(int rank, int set) const;
  uint8_t* Out(int rank, int set) const;
  // The rounds of ReduceScatter and Allgather, over one barrier each: fill(0), then
  // after barrier r drain(r) and fill(r + 1), each given round r's slot set.
  Status Rounds(int64_t rounds, const std::function<void(int64_t, int)>& fill,
                const std::function<void(int64_t, int)>& drain);
  // Spins for `spin` before sleeping.
  Status Barrier(std::chrono::microseconds spin);
  static constexpr std::chrono::microseconds kChunkSpin{20};
  static constexpr std::chrono::microseconds kCoordinationSpin{50};
  // How often a sleeping barrier wakes to call idle_: a ring step that ends while the
  // host waits is noticed within this, and the next one posted.
  static constexpr int64_t kIdleWakeUs = 200;
  // The first rank whose process has ended, or -1.
  int DeadPeer() const;

  const int rank_, size_;
  const std::vector<uint8_t*> segments_;
  const std::vector<int64_t> pids_;
  int set_ = 0;    // slot set of the next chunk
  int bits_set_ = 0;  // bit-vector area of the next AndBits
  int sense_ = 0;  // this rank's barrier sense
  int64_t chunk_bytes_ = kChunkBytes;
  std::function<Status()> idle_;
};

}  // namespace hvdlite
