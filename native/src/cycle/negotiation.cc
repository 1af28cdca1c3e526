// One round of a process set (ProcessSetState::RunCycle, steps 1-3 of the cycle that
// core/loop.cc describes): sort the new requests by cache state, coordinate with one
// bit-vector allreduce, negotiate what is not cached through the set's rank 0; then
// execution.cc runs what is ready. The cycle's thread only (core/loop.cc).
#include "cycle/process_set.h"

#include <algorithm>
#include <cstring>

#include "common/elementwise.h"

namespace hvdlite {
namespace {

// Whether an allreduce's result cannot depend on the order its ranks' values are
// combined in: integers (any op: exact, or wrapping alike), and floats' sums, averages
// and products of two ranks (one commutative step; a NaN's payload aside). Not floats'
// Min and Max: with a NaN or zeros of both signs, which one comes out depends on the
// order.
bool OrderFree(const Response& r, int size) {
  const int32_t d = r.dtype;
  const bool floating = d == HVDLITE_FLOAT16 || d == HVDLITE_BFLOAT16 || d == HVDLITE_FLOAT32 || d == HVDLITE_FLOAT64;
  return !floating || (size <= 2 && r.reduce_op != HVDLITE_MIN && r.reduce_op != HVDLITE_MAX);
}

// Timeline names of the negotiation, by HVDLITE_OP_*.
const char* const kNegotiateActivity[] = {"NEGOTIATE_ALLREDUCE", "NEGOTIATE_ALLGATHER",
                                          "NEGOTIATE_BROADCAST", "NEGOTIATE_ALLTOALL",
                                          "NEGOTIATE_REDUCESCATTER", "NEGOTIATE_BARRIER",
                                          "NEGOTIATE_JOIN", "NEGOTIATE_ADD_PROCESS_SET",
                                          "NEGOTIATE_REMOVE_PROCESS_SET"};

}  // namespace

void ProcessSetState::Refuse(Request q) {
  int64_t slot = -1;
  if (cache_ && cache_->Find(q, &slot) != ResponseCache::Lookup::kMiss) invalid_slots_.insert(slot);
  uncached_.push_back(std::move(q));
}

bool ProcessSetState::EndLoop(const Status& s) {
  end_loop_(s);
  failed_ = true;
  return false;
}

void ProcessSetState::LeftJoin() {
  Request q = std::move(*leave_join_);
  leave_join_.reset();
  TensorEntry* join = queue_.Find(kJoinName);
  if (!join) return;  // it ended meanwhile (every rank had joined), or there was none
  const hvdlite_handle_t h = join->handle;
  queue_.Remove(kJoinName);
  local_joined_ = false;
  counters_.errors++;
  handles_.Complete(h, Status(HVDLITE_ERR_ABORTED,
                              "join() was left before every rank had joined (its caller gave up "
                              "waiting); this rank takes part in collectives as before"));
  auto sent = std::find_if(uncached_.begin(), uncached_.end(),
                           [](const Request& q) { return q.op == HVDLITE_OP_JOIN; });
  if (sent != uncached_.end()) {
    uncached_.erase(sent);  // not sent yet: the coordinator never counted this rank joined
    return;
  }
  q.rank = rank_;
  // First in this round: this cycle's requests (another thread's, say) come after it.
  uncached_.insert(uncached_.begin(), std::move(q));
}

bool ProcessSetState::RunCycle(Clock::time_point now, const RoundFlags& mine, RoundFlags* heard) {
  mpi_->set_caller_waiting(handles_.announced().load() > 0);
  SortFresh(now);
  if (leave_join_) LeftJoin();
  bool any_uncached = false;
  std::vector<Response> ready;
  if (!Coordinate(now, mine, &any_uncached, heard, &ready)) return false;
  if (any_uncached && !Negotiate(now, &ready)) return false;
  Execute(ready);
  return !failed_;
}

void ProcessSetState::SortFresh(Clock::time_point now) {
  const bool tl = timeline_.active();
  std::vector<const std::string*> cached_names;  // timeline: rank 0 ready, cache path
  if (tl) {
    // Every fresh request opens its negotiation: one timeline event per kind of op.
    std::vector<const std::string*> names;
    for (int32_t op = 0; op < HVDLITE_OP_JOIN; ++op) {
      names.clear();
      for (const TensorEntry* e : fresh_) {
        if (e->request.op == op) names.push_back(&e->request.name);
      }
      timeline_.BeginNegotiationAll(names, kNegotiateActivity[op]);
    }
  }
  for (const TensorEntry* e : fresh_) {
    const Request& q = e->request;
    if (q.op == HVDLITE_OP_JOIN) local_joined_ = true;
    int64_t slot = -1;
    auto lookup = ResponseCache::Lookup::kMiss;
    if (cache_ && !join_active_ && q.group.empty() && q.op != HVDLITE_OP_JOIN &&
        q.op < HVDLITE_OP_ADD_PROCESS_SET) {
      lookup = cache_->Find(q, &slot);
    }
    if (lookup == ResponseCache::Lookup::kHit) {
      // Cached: the other ranks' readiness reaches rank 0 only as one "all ranks
      // ready" bit, marked when the bit vector comes back.
      if (tl) cached_names.push_back(&q.name);
      cached_pending_[slot] = now;
      continue;
    }
    if (lookup == ResponseCache::Lookup::kChanged) invalid_slots_.insert(slot);
    uncached_.push_back(q);
  }
  fresh_.clear();
  timeline_.InstantAll(cached_names, "rank 0 ready", "\"cached\": true");
  // A cached tensor waiting long on this rank goes back through the coordinator,
  // which can tell who is missing (a bit vector cannot).
  double stall_s = config_.stall_check_s;
  if (config_.stall_shutdown_s > 0 && (stall_s <= 0 || config_.stall_shutdown_s < stall_s)) {
    stall_s = config_.stall_shutdown_s;
  }
  if (stall_s > 0) {
    for (auto& kv : cached_pending_) {
      if (std::chrono::duration<double>(now - kv.second).count() > stall_s / 2) {
        invalid_slots_.insert(kv.first);
      }
    }
  }
}

bool ProcessSetState::ReducesInDataOrder(const Response& r, int64_t words) const {
  if (r.op == HVDLITE_OP_REDUCESCATTER && mpi_->shared_memory()) return true;
  if (!mpi_->CarriesInDataOrder(words, Tuning())) return false;
  return r.op == HVDLITE_OP_ALLREDUCE ||
         (r.op == HVDLITE_OP_REDUCESCATTER && NumElements(r.shape) * ElementSize(r.dtype) <= ShmCollectives::kCompanionBytes);
}

bool ProcessSetState::ReducescatterByLayers(const Response& r) const {
  return !mpi_->shared_memory() && ReducesInDataOrder(r, static_cast<int64_t>(Bits().size()));
}

ProcessSetState::BitsLayout ProcessSetState::Bits() const {
  // The global set's round also carries rank 0's autotune decision (autotune.h says why).
  return BitsLayout{cache_ ? static_cast<size_t>(cache_->capacity() + 63) / 64 : 0,
                    id() == 0 ? autotune_.Words() : 0};
}

int64_t ProcessSetState::CallerCycleBytes() const {
  return mpi_ ? mpi_->CallerCycleBytes(static_cast<int64_t>(Bits().size())) : 0;
}

bool ProcessSetState::Coordinate(Clock::time_point now, const RoundFlags& mine, bool* any_uncached,
                                 RoundFlags* heard, std::vector<Response>* ready) {
  const BitsLayout layout = Bits();
  const size_t words = layout.words, tuned = layout.tuned;
  std::vector<uint64_t> bits(layout.size(), 0);
  uint64_t flags = 0;
  bool wants_round = controller_ && controller_->WantsRound(now);
  if (!uncached_.empty() || wants_round) flags |= 1;
  if (mine.shutdown) flags |= 2;
  if (local_joined_) flags |= 4;
  if (mine.elsewhere) flags |= 8;
  // BAND over inverted flags is an OR over ranks.
  bits[0] = ~flags;
  for (auto& kv : cached_pending_) {
    if (!invalid_slots_.count(kv.first)) bits[1 + kv.first / 64] |= 1ull << (kv.first % 64);
  }
  for (size_t i = 0; i < words; ++i) bits[1 + words + i] = ~0ull;
  for (int64_t slot : invalid_slots_) bits[1 + words + slot / 64] &= ~(1ull << (slot % 64));
  const CarriedOp carried = Carry(static_cast<int64_t>(bits.size()));
  invalid_slots_.clear();
  if (tuned) autotune_.Publish(&bits[1 + 2 * words]);

  Status s = mpi_->AndBits(&bits, carried);
  if (!s.ok()) return EndLoop(s);
  if (tuned) autotune_.Adopt(&bits[1 + 2 * words], now);
  flags = ~bits[0];
  bool any_joined = flags & 4;
  *any_uncached = flags & 1;
  if (flags & 2) heard->shutdown = true;
  if (flags & 8) heard->elsewhere = true;

  auto to_uncached = [&](int64_t slot) { PendingToCoordinator(cached_pending_.find(slot)); };
  for (size_t w = 0; w < words; ++w) {
    uint64_t invalid = ~bits[1 + words + w];
    while (invalid) {
      int64_t slot = static_cast<int64_t>(w * 64 + __builtin_ctzll(invalid));
      invalid &= invalid - 1;
      if (!cache_->Has(slot)) continue;
      if (cached_pending_.count(slot)) to_uncached(slot);
      cache_->Erase(slot);
    }
  }
  join_active_ = any_joined;
  if (any_joined) {
    while (!cached_pending_.empty()) to_uncached(cached_pending_.begin()->first);
  }

  for (size_t w = 0; w < words; ++w) {
    uint64_t hit = bits[1 + w];
    while (hit) {
      int64_t slot = static_cast<int64_t>(w * 64 + __builtin_ctzll(hit));
      hit &= hit - 1;
      if (!cache_->Has(slot) || !cached_pending_.count(slot)) continue;
      cache_->Touch(slot);
      ready->push_back(cache_->Get(slot));
      cached_pending_.erase(slot);
      counters_.cache_hits++;
    }
  }
  carried_.clear();
  if (carried.tag >= 0 && Carried(carried, static_cast<int64_t>(bits.size()), *ready)) {
    carried_ = ready->front().name;
  }
  if (timeline_.active() && !ready->empty()) {
    std::vector<const std::string*> cached_names;
    for (const Response& r : *ready) cached_names.push_back(&r.name);
    timeline_.InstantAll(cached_names, "all ranks ready", "\"cached\": true");
  }
  return true;
}

namespace {

// What rank k of `size` puts into the round for a carried op of response r: an
// allgather's rows, an alltoall's whole input, the whole tensor of the others.
int64_t CarriedBytes(const Response& r, int k, int size) {
  const int64_t row = RowElements(r.shape) * ElementSize(r.dtype);
  if (r.op == HVDLITE_OP_ALLGATHER) return r.first_dims[k] * row;
  if (r.op != HVDLITE_OP_ALLTOALL) return NumElements(r.shape) * ElementSize(r.dtype);
  int64_t rows = 0;
  for (int j = 0; j < size; ++j) rows += r.splits[static_cast<size_t>(k) * size + j];
  return rows * row;
}

}  // namespace

CarriedOp ProcessSetState::Carry(int64_t words) {
  // Only a rank's only request (nothing uncached, no other cached op, no join) is
  // carried: then the op is the round's only cached one wherever every member carries
  // it, and ready holds it alone.
  CarriedOp none;
  if (!config_.carry_data || cached_pending_.size() != 1 || !uncached_.empty() || join_active_ ||
      local_joined_) {
    return none;
  }
  const int64_t slot = cached_pending_.begin()->first;
  if (invalid_slots_.count(slot)) return none;
  const Response& r = cache_->Get(slot);
  if (r.on_device) return none;
  const size_t size = static_cast<size_t>(size_);
  const bool gather = (r.op == HVDLITE_OP_ALLGATHER && r.first_dims.size() == size) ||
                      (r.op == HVDLITE_OP_ALLTOALL && r.splits.size() == size * size);
  const bool reduce = r.op == HVDLITE_OP_ALLREDUCE || r.op == HVDLITE_OP_REDUCESCATTER;
  if (!gather && !reduce && r.op != HVDLITE_OP_BROADCAST) return none;
  // Carried, a reduction reduces as its data path would through shared memory or over
  // the hosts' layers (in rank order, then host order: ReducesInDataOrder); MPI's own
  // order (a flat allreduce, a reducescatter across hosts without the layers) may give
  // other bits in a float's last place, so there only what no order changes is carried:
  // every result then the same bits whether its op was carried or not.
  if (reduce && !ReducesInDataOrder(r, words) && !OrderFree(r, size_)) return none;
  const int64_t nbytes = CarriedBytes(r, rank_, size_);
  uint8_t* companion = nbytes > 0 ? mpi_->Companion(nbytes, words) : nullptr;
  TensorEntry* e = companion ? queue_.Find(r.name) : nullptr;
  if (!e || !e->input) return none;
  const bool broadcast = r.op == HVDLITE_OP_BROADCAST;
  const int64_t n = nbytes / ElementSize(r.dtype);
  if (reduce) {
    ScaledCopy(companion, e->input, n, r.dtype, r.prescale, 1);  // as the data path's copy in
  } else if (gather || rank_ == r.root_rank) {
    std::memcpy(companion, e->input, nbytes);
  }
  CarriedOp carried;
  carried.tag = slot;
  carried.nbytes = nbytes;
  carried.count = n;
  carried.dtype = r.dtype;
  carried.reduce_op = r.reduce_op == HVDLITE_AVERAGE ? HVDLITE_SUM : r.reduce_op;  // divided after
  carried.root = broadcast ? r.root_rank : -1;
  carried.gather = gather;
  return carried;
}

bool ProcessSetState::Carried(const CarriedOp& carried, int64_t words, const std::vector<Response>& ready) {
  // Every member reads the same records: the same answer everywhere.
  if (ready.size() != 1 || !cache_->Has(carried.tag) || ready.front().name != cache_->Get(carried.tag).name) {
    return false;
  }
  const Response& r = ready.front();
  // Autotune may have changed the allreduce's algorithm in this round (Adopt, after
  // Carry): carried in rank order, a reduction must still be in the data path's order
  // (the knobs are the same on every rank).
  const bool reduce = r.op == HVDLITE_OP_ALLREDUCE || r.op == HVDLITE_OP_REDUCESCATTER;
  if (reduce && !OrderFree(r, size_) && !ReducesInDataOrder(r, words)) return false;
  if (!mpi_->CarriedParts(carried, &carried_parts_, &carried_lengths_)) return false;
  if (!carried.gather) return true;
  // An allgather's or alltoall's parts: every rank's data, or (the layered round) each
  // host's ranks' one after another, hosts of as many consecutive ranks each. Each
  // rank's found there, its length checked against the response's.
  const int parts = static_cast<int>(carried_parts_.size());
  if (parts == 0 || size_ % parts != 0) return false;
  const int per = size_ / parts;
  carried_ranks_.resize(size_);
  for (int k = 0; k < parts; ++k) {
    int64_t at = 0;
    for (int j = k * per; j < (k + 1) * per; ++j) {
      carried_ranks_[j] = carried_parts_[k] + at;
      at += CarriedBytes(r, j, size_);
    }
    if (carried_lengths_[k] != at) return false;
  }
  return true;
}

bool ProcessSetState::Negotiate(Clock::time_point now, std::vector<Response>* ready) {
  counters_.coordinator_gathers++;
  counters_.cache_misses += static_cast<int64_t>(uncached_.size());
  for (Request& q : uncached_) {
    TensorEntry* e = queue_.Find(q.name);
    q.wait_ms = e ? std::chrono::duration_cast<std::chrono::milliseconds>(now - e->enqueued).count() : 0;
  }
  std::vector<uint8_t> mine;
  SerializeRequests(uncached_, &mine);
  uncached_.clear();
  std::vector<std::vector<uint8_t>> all;
  Status s = mpi_->GatherBlobs(mine, &all);
  std::vector<uint8_t> blob;
  if (s.ok() && controller_) {
    for (size_t r = 0; r < all.size() && s.ok(); ++r) {
      std::vector<Request> reqs;
      s = ParseRequests(all[r].data(), all[r].size(), &reqs);
      for (const Request& q : reqs) {
        if (timeline_.active() && q.op != HVDLITE_OP_JOIN && q.refusal.empty()) {
          timeline_.BeginNegotiation(q.name, kNegotiateActivity[q.op]);
          timeline_.Instant(q.name, "rank " + std::to_string(q.rank) + " ready");
        }
        controller_->AddRequest(q, now);
      }
    }
    SerializeResponses(controller_->BuildResponses(now), &blob);
  }
  if (s.ok()) s = mpi_->BroadcastBlob(&blob);
  std::vector<Response> fresh_responses;
  if (s.ok()) s = ParseResponses(blob.data(), blob.size(), &fresh_responses);
  if (!s.ok()) return EndLoop(s);
  for (Response& r : fresh_responses) {
    if (r.cacheable && cache_ && r.error.empty()) {
      // Every rank submitted a cacheable tensor, so each has its own request here;
      // Put runs on every rank in this same order, keeping slots identical.
      TensorEntry* e = queue_.Find(r.name);
      Request local = e ? e->request : Request();
      if (!e) local.name = r.name;
      // A slot this rank waits on as a hit, about to be given to another name (the
      // least recently used of a full cache): its request goes to the coordinator next
      // round, as its peers' will (they miss), instead of waiting on a bit no one sets.
      const int64_t slot = cache_->SlotFor(r.name);
      auto pending = cached_pending_.find(slot);
      if (pending != cached_pending_.end() && cache_->Get(slot).name != r.name) {
        PendingToCoordinator(pending);
      }
      cache_->Put(slot, local, r);
    }
    ready->push_back(std::move(r));
  }
  return true;
}

void ProcessSetState::PendingToCoordinator(std::map<int64_t, Clock::time_point>::iterator pending) {
  TensorEntry* e = queue_.Find(cache_->Get(pending->first).name);
  if (e) uncached_.push_back(e->request);
  cached_pending_.erase(pending);
}

}  // namespace hvdlite
