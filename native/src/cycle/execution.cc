// Execution of a round's ready responses (step 4 of the cycle that core/loop.cc
// describes): plan which allreduces and allgathers fuse, run each collective, complete
// its handles. The cycle's thread only (core/loop.cc).
#include "cycle/process_set.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "common/elementwise.h"

namespace hvdlite {
namespace {

// Over MPI, tensors this large are reduced alone, in place: copying them into and out
// of the fusion buffer costs more than the collective's fixed latency that fusion
// saves. (Through shared memory every tensor is read in place, so any size fuses.)
constexpr int64_t kFuseAloneBytes = 1 << 20;

// Timeline names of the operation span, by HVDLITE_OP_*.
const char* const kOpActivity[] = {"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL",
                                   "REDUCESCATTER", "BARRIER", "JOIN", "ADD_PROCESS_SET",
                                   "REMOVE_PROCESS_SET"};

// Arguments of an op's timeline span. bytes: what rank 0 contributes or receives.
std::string TimelineArgs(const Response& r, size_t fused, int rank, int size) {
  const int64_t elem = ElementSize(r.dtype);
  const int64_t row = RowElements(r.shape) * elem;
  int64_t bytes = NumElements(r.shape) * elem;
  if (r.op == HVDLITE_OP_ALLGATHER) {
    bytes = 0;
    for (int64_t rows : r.first_dims) bytes += rows * row;
  } else if (r.op == HVDLITE_OP_ALLTOALL) {
    bytes = 0;
    for (int k = 0; k < size && static_cast<size_t>(k) * size + rank < r.splits.size(); ++k) {
      bytes += r.splits[static_cast<size_t>(k) * size + rank] * row;
    }
  } else if (r.op == HVDLITE_OP_BARRIER) {
    bytes = 0;
  }
  std::string args = std::string("\"dtype\": \"") + DtypeName(r.dtype) + "\", \"shape\": \"" +
                     ShapeString(r.shape) + "\", \"bytes\": " + std::to_string(bytes);
  if (r.op == HVDLITE_OP_ALLREDUCE) args += ", \"fused\": " + std::to_string(fused);
  return args;
}

// The timeline activity of each op's collective itself, by HVDLITE_OP_*.
const char* const kCollectiveActivity[] = {"MPI_ALLREDUCE", "MPI_ALLGATHER", "MPI_BROADCAST",
                                           "MPI_ALLTOALL", "MPI_REDUCESCATTER", "MPI_BARRIER",
                                           "MPI_JOIN", "MPI_COMM_SPLIT", "MPI_COMM_FREE"};

// The activities of one execution on the timeline, one after the other: each ends
// where the next begins and is recorded, once ended, as one event over all the
// execution's tracks. Does nothing while the timeline is off.
class Activities {
 public:
  Activities(Timeline& timeline, const std::vector<const std::string*>& tensors, int64_t start_us)
      : timeline_(timeline), tids_(timeline.OpenTracks(tensors)), start_us_(start_us) {}
  // The activity that began where the previous one ended has ended now.
  void Done(const char* activity) {
    if (tids_.empty()) return;
    int64_t now = Timeline::Now();
    timeline_.Complete(tids_, activity, start_us_, now);
    start_us_ = now;
  }

 private:
  Timeline& timeline_;
  std::vector<int> tids_;
  int64_t start_us_;
};

// A digest of everything TimelineArgs shows.
uint64_t TimelineArgsKey(const Response& r, size_t fused) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  mix(static_cast<uint64_t>(r.op));
  mix(static_cast<uint64_t>(r.dtype));
  mix(fused);
  for (int64_t d : r.shape) mix(static_cast<uint64_t>(d));
  mix(~0ull);
  for (int64_t d : r.first_dims) mix(static_cast<uint64_t>(d));
  mix(~0ull);
  for (int64_t s : r.splits) mix(static_cast<uint64_t>(s));
  return h;
}

}  // namespace

int64_t WireBytes(int32_t op, int64_t payload, int size) {
  if (size <= 1) return 0;
  const int64_t share = payload / size * (size - 1);
  return op == HVDLITE_OP_ALLREDUCE ? 2 * share : share;
}

void ProcessSetState::Finish(TensorEntry* e, const Status& status, OpOutput out) {
  if (!e) return;
  // Host tensors (every op but a staged one) complete with the status as given, uncopied.
  Status after_copy_back;
  const Status& s = staged_.empty() ? status : (after_copy_back = StageOut({e}, status));
  hvdlite_handle_t h = e->handle;
  queue_.Remove(e->request.name);  // e is gone from here on
  if (s.ok()) {
    counters_.tensors++;
  } else {
    counters_.errors++;
  }
  handles_.Complete(h, s, std::move(out));
}

void ProcessSetState::FinishAll(const std::vector<TensorEntry*>& entries, const Status& status) {
  Status after_copy_back;
  const Status& s = staged_.empty() ? status : (after_copy_back = StageOut(entries, status));
  std::vector<hvdlite_handle_t> handles = queue_.RemoveAll(entries);  // entries gone
  (s.ok() ? counters_.tensors : counters_.errors) += static_cast<int64_t>(handles.size());
  handles_.CompleteAll(handles, s);
}

void ProcessSetState::Execute(const std::vector<Response>& ready) {
  const std::vector<size_t> ends = PlanFusion(ready);
  if (timeline_.active()) BeginOpsOnTimeline(ready, ends);
  size_t i = 0;
  for (size_t end : ends) {
    const Response& r = ready[i];
    if (!r.error.empty()) {
      // An error for some ranks only (a late submission of a refused tensor) leaves
      // the others' entries of that name alone: theirs may be a later op of it.
      if (r.targets.empty() || r.targets[rank_]) Finish(queue_.Find(r.name), Status(r.error_code, r.error));
    } else if (r.on_device) {
      ExecuteOnDevice(ready, i, end);
    } else if (r.op == HVDLITE_OP_ALLGATHER && end - i > 1) {
      std::vector<const Response*> fused;
      for (size_t k = i; k < end; ++k) fused.push_back(&ready[k]);
      ExecuteFusedAllgather(fused);
    } else if (r.op != HVDLITE_OP_ALLREDUCE) {
      ExecuteOne(r);
    } else {
      std::vector<const Response*> fused;
      for (size_t k = i; k < end; ++k) fused.push_back(&ready[k]);
      ExecuteAllreduce(fused);
    }
    i = end;
  }
  carried_.clear();  // its data is the peers' again from the next round on
}

// ready[begin, ends[n]) is one collective, a run of compatible allreduces fused under
// the threshold or one other response. Every field used here comes from the responses,
// which are identical on all ranks, and the threshold in force (autotune changes it
// only between cycles, on every rank alike).
std::vector<size_t> ProcessSetState::PlanFusion(const std::vector<Response>& ready) const {
  const int64_t threshold = autotune_.knobs().fusion_threshold;
  // Through shared memory (flat or hierarchical) an allreduce reads its tensors in
  // place, so large ones fuse for free and save a round each; over MPI alone they go by
  // themselves (the fusion buffer's copies would cost more than the round).
  const int64_t fuse_alone_bytes = mpi_->ChooseAllreduce(Tuning()) != AllreduceAlgorithm::kMpi
                                       ? std::numeric_limits<int64_t>::max()
                                       : kFuseAloneBytes;
  std::vector<size_t> ends;
  for (size_t i = 0; i < ready.size();) {
    const Response& r = ready[i];
    size_t j = i + 1;
    int64_t bytes = NumElements(r.shape) * ElementSize(r.dtype);
    if (r.op == HVDLITE_OP_ALLGATHER && r.error.empty()) {
      // Allgathers fuse by bytes alone: every rank's pieces travel in one Allgatherv.
      int64_t gathered = AllgatherBytes(r);
      while (threshold > 0 && gathered < kFuseAloneBytes && j < ready.size()) {
        const Response& c = ready[j];
        if (c.op != HVDLITE_OP_ALLGATHER || !c.error.empty() || c.on_device != r.on_device) break;
        int64_t b = AllgatherBytes(c);
        if (b >= kFuseAloneBytes || gathered + b > threshold) break;
        gathered += b;
        ++j;
      }
    } else if (r.op == HVDLITE_OP_ALLREDUCE && r.error.empty() && bytes < fuse_alone_bytes) {
      while (threshold > 0 && j < ready.size()) {
        const Response& c = ready[j];
        int64_t b = NumElements(c.shape) * ElementSize(c.dtype);
        if (c.op != HVDLITE_OP_ALLREDUCE || !c.error.empty() || b >= fuse_alone_bytes || c.dtype != r.dtype ||
            c.on_device != r.on_device ||
            c.reduce_op != r.reduce_op || !SameFactor(c.prescale, r.prescale) ||
            !SameFactor(c.postscale, r.postscale) ||
            c.contributors != r.contributors || bytes + b > threshold) {
          break;
        }
        bytes += b;
        ++j;
      }
    }
    ends.push_back(j);
    i = j;
  }
  return ends;
}

// Negotiation ends for the whole list at once; the time a tensor then waits for the
// collectives ahead of it is its QUEUE activity, ended when its own one starts.
void ProcessSetState::BeginOpsOnTimeline(const std::vector<Response>& ready, const std::vector<size_t>& ends) {
  size_t begin = 0;
  std::vector<const std::string*> names;
  for (size_t end : ends) {
    names.clear();
    for (size_t k = begin; k < end; ++k) {
      if (ready[k].op != HVDLITE_OP_JOIN) names.push_back(&ready[k].name);
    }
    timeline_.EndAll(names);
    if (ready[begin].error.empty() && !names.empty()) {
      // A collective's ops are of one kind: one call for them all.
      const size_t fused = end - begin;
      std::vector<const Response*> ops;
      for (size_t k = begin; k < end; ++k) {
        if (ready[k].op != HVDLITE_OP_JOIN) ops.push_back(&ready[k]);
      }
      timeline_.BeginOps(
          names, kOpActivity[ops[0]->op],
          [&](size_t n) { return TimelineArgsKey(*ops[n], fused); },
          [&](size_t n) { return TimelineArgs(*ops[n], fused, rank_, size_); });
    }
    begin = end;
  }
  queue_start_us_ = Timeline::Now();
}

AllreduceTuning ProcessSetState::Tuning() const {
  return AllreduceTuning{autotune_.knobs().hierarchical, autotune_.knobs().shm_chunk_bytes};
}

// The backend chooses the algorithm (MpiBackend::Allreduce); this fuses the run into
// pieces, read in place, and completes it.
void ProcessSetState::ExecuteAllreduce(const std::vector<const Response*>& fused) {
  const Response& first = *fused[0];
  const bool average = first.reduce_op == HVDLITE_AVERAGE;
  AllreduceOptions options;
  options.dtype = first.dtype;
  options.reduce_op = average ? HVDLITE_SUM : first.reduce_op;
  options.prescale = first.prescale;
  options.postscale = first.postscale;
  options.divisor = average ? std::max(1, first.contributors) : 1;
  const bool tl = timeline_.active();
  std::vector<TensorEntry*> entries =
      queue_.FindAll(fused, [](const Response* r) -> const std::string& { return r->name; });
  std::vector<const std::string*> names;  // timeline tracks
  std::vector<ShmCollectives::Piece> pieces;
  pieces.reserve(fused.size());
  int64_t total = 0;
  for (size_t k = 0; k < fused.size(); ++k) {
    const int64_t n = NumElements(fused[k]->shape);
    TensorEntry* e = entries[k];  // null: this rank joined and contributes zeros
    pieces.push_back({e ? e->input : nullptr, e ? e->output : nullptr, n});
    total += n;
    if (tl) names.push_back(&fused[k]->name);
  }
  Activities activities(timeline_, names, queue_start_us_);
  activities.Done("QUEUE");
  const AllreduceTuning tuning = Tuning();
  const AllreduceAlgorithm algorithm = mpi_->ChooseAllreduce(tuning);
  const auto step = [&](const char* name) { activities.Done(name); };
  const bool carried = fused.size() == 1 && entries[0] && first.name == carried_;
  Status s = carried          ? ReduceCarried(first, entries[0], options)
             : first.on_device ? AllreduceStaged(entries, pieces, options, tuning, step)
                               : mpi_->Allreduce(pieces, options, tuning, &fusion_, step);
  if (carried) activities.Done("CARRIED_ALLREDUCE");
  if (tl) timeline_.EndAll(names);  // ALLREDUCE
  const int64_t bytes = total * ElementSize(options.dtype);
  counters_.collectives++;
  if (carried) {
    CountCarried();
  } else if (algorithm == AllreduceAlgorithm::kSharedMemory) {
    counters_.shm_collectives++;
  }
  if (algorithm == AllreduceAlgorithm::kLayers) counters_.hierarchical_collectives++;
  if (fused.size() > 1) counters_.fused_collectives++;
  counters_.bytes += bytes;
  counters_.wire_bytes += WireBytes(HVDLITE_OP_ALLREDUCE, bytes, size_);
  FinishAll(entries, s);
  if (!s.ok()) EndLoop(s);
}

// Bytes of one allgather's result (all ranks' rows).
int64_t ProcessSetState::AllgatherBytes(const Response& r) {
  int64_t rows = 0;
  for (int64_t d : r.first_dims) rows += d;
  return rows * RowElements(r.shape) * ElementSize(r.dtype);
}

// Several allgathers in one Allgatherv: each rank sends its tensors' rows back to back,
// so rank k's block holds, per tensor in order, first_dims[k] rows of it.
void ProcessSetState::ExecuteFusedAllgather(const std::vector<const Response*>& fused) {
  const int size = size_, me = rank_;
  const bool tl = timeline_.active();
  std::vector<const std::string*> names;
  std::vector<TensorEntry*> entries;
  std::vector<int64_t> row_bytes;
  std::vector<int64_t> block(size, 0);  // bytes each rank contributes
  for (const Response* r : fused) {
    entries.push_back(queue_.Find(r->name));
    row_bytes.push_back(RowElements(r->shape) * ElementSize(r->dtype));
    for (int k = 0; k < size; ++k) block[k] += r->first_dims[k] * row_bytes.back();
    if (tl) names.push_back(&r->name);
  }
  int64_t total = 0;
  for (int64_t b : block) total += b;
  Activities activities(timeline_, names, queue_start_us_);
  activities.Done("QUEUE");
  // Through shared memory the blocks go straight into the outputs; over MPI they arrive
  // back to back after this rank's block in the fusion buffer, and are unpacked.
  const bool shm = mpi_->ShmGathers();
  uint8_t* buf = fusion_.Get(block[me] + (shm ? 0 : total));
  uint8_t* send = buf;
  uint8_t* recv = buf + block[me];
  int64_t off = 0;
  for (size_t t = 0; t < fused.size(); ++t) {
    int64_t n = fused[t]->first_dims[me] * row_bytes[t];
    if (entries[t] && n > 0) std::memcpy(send + off, entries[t]->input, n);
    off += n;
  }
  activities.Done("MEMCPY_IN_FUSION_BUFFER");
  // Where rank k's rows of tensor t go in its output, in the blocks' order.
  std::vector<OpOutput> outs(fused.size());
  std::vector<ShmCollectives::Piece> places;
  for (size_t t = 0; t < fused.size(); ++t) outs[t].Allocate(AllgatherBytes(*fused[t]));
  for (int k = 0; k < size; ++k) {
    for (size_t t = 0; t < fused.size(); ++t) {
      places.push_back({nullptr, outs[t].data.get() + outs[t].first_dim * row_bytes[t],
                        fused[t]->first_dims[k] * row_bytes[t]});
      outs[t].first_dim += fused[t]->first_dims[k];
    }
  }
  Status s = shm ? mpi_->ShmAllgatherv(send, places, block) : mpi_->Allgatherv(send, block[me], recv, block);
  activities.Done(shm ? "SHM_ALLGATHER" : "MPI_ALLGATHER");
  if (mpi_->hierarchical_allgather()) counters_.hierarchical_collectives++;
  if (shm) counters_.shm_collectives++;
  if (s.ok() && !shm) {
    int64_t at = 0;
    for (const ShmCollectives::Piece& p : places) {
      if (p.count > 0) std::memcpy(p.out, recv + at, p.count);
      at += p.count;
    }
  }
  if (!s.ok()) {
    for (OpOutput& out : outs) out = OpOutput();  // a failed op returns no rows
  }
  activities.Done("MEMCPY_OUT_FUSION_BUFFER");
  if (tl) timeline_.EndAll(names);  // ALLGATHER
  counters_.collectives++;
  counters_.fused_collectives++;
  counters_.bytes += total;
  counters_.wire_bytes += WireBytes(HVDLITE_OP_ALLGATHER, total, size);
  for (size_t t = 0; t < fused.size(); ++t) Finish(entries[t], s, std::move(outs[t]));
  if (!s.ok()) EndLoop(s);
}

void ProcessSetState::ExecuteOne(const Response& r) {
  TensorEntry* e = r.op == HVDLITE_OP_JOIN ? queue_.Find(kJoinName) : queue_.Find(r.name);
  const bool tl = timeline_.active() && r.op != HVDLITE_OP_JOIN;
  std::vector<const std::string*> names;
  if (tl) names.push_back(&r.name);
  Activities activities(timeline_, names, queue_start_us_);
  activities.Done("QUEUE");
  OpOutput out;
  OpTally tally;
  Status s = RunOp(r, e, &out, &tally);
  if (tl) {
    activities.Done(tally.activity ? tally.activity : kCollectiveActivity[r.op]);
    timeline_.End(r.name);
  }
  if (r.op != HVDLITE_OP_JOIN) {
    counters_.collectives++;
    counters_.bytes += tally.moved;
    counters_.wire_bytes += tally.sent_away >= 0 ? tally.sent_away : WireBytes(r.op, tally.moved, size_);
  }
  Finish(e, s, std::move(out));
  if (!s.ok()) EndLoop(s);
}

Status ProcessSetState::RunOp(const Response& r, TensorEntry* e, OpOutput* out, OpTally* tally) {
  switch (r.op) {
    case HVDLITE_OP_ALLGATHER: return ExecuteAllgather(r, e, out, tally);
    case HVDLITE_OP_BROADCAST: return ExecuteBroadcast(r, e, tally);
    case HVDLITE_OP_ALLTOALL: return ExecuteAlltoall(r, e, out, tally);
    case HVDLITE_OP_REDUCESCATTER: return ExecuteReducescatter(r, e, tally);
    case HVDLITE_OP_BARRIER:
      // Ready means every member submitted it (every bit of the round, or every request
      // at the coordinator), so the round that made it ready was the barrier. (While a
      // rank is joined, a barrier fails at the coordinator: Controller::Validate.)
      return Status::OK();
    case HVDLITE_OP_JOIN:
      local_joined_ = false;
      out->first_dim = r.last_joined_rank;
      return Status::OK();
    case HVDLITE_OP_ADD_PROCESS_SET: return AddSet(r, out);
    case HVDLITE_OP_REMOVE_PROCESS_SET: return RemoveSet(r);
  }
  return Status::OK();
}

// e is null on a rank that joined: it sends no rows.
Status ProcessSetState::ExecuteAllgather(const Response& r, TensorEntry* e, OpOutput* out, OpTally* tally) {
  const int size = size_;
  int64_t row = RowElements(r.shape) * ElementSize(r.dtype);
  std::vector<int64_t> bytes(size);
  int64_t total = 0;
  for (int k = 0; k < size; ++k) {
    bytes[k] = r.first_dims[k] * row;
    total += bytes[k];
    out->first_dim += r.first_dims[k];
  }
  out->Allocate(total);
  if (e && r.name == carried_) {  // every rank's rows came with the round, in rank order
    uint8_t* at = out->data.get();
    for (size_t k = 0; k < carried_parts_.size(); ++k) {
      std::memcpy(at, carried_parts_[k], carried_lengths_[k]);
      at += carried_lengths_[k];
    }
    tally->moved = total;
    tally->activity = "CARRIED_ALLGATHER";
    CountCarried();
    return Status::OK();
  }
  Status s = mpi_->Allgatherv(e ? e->input : nullptr, bytes[rank_], out->data.get(), bytes);
  tally->moved = total;
  if (mpi_->hierarchical_allgather()) counters_.hierarchical_collectives++;
  if (mpi_->ShmGathers()) {
    counters_.shm_collectives++;
    tally->activity = "SHM_ALLGATHER";
  }
  return s;
}

Status ProcessSetState::ExecuteBroadcast(const Response& r, TensorEntry* e, OpTally* tally) {
  int64_t nbytes = NumElements(r.shape) * ElementSize(r.dtype);
  void* target = e ? e->output : fusion_.Get(nbytes);  // a joined rank receives and drops
  if (e && r.name == carried_) {  // the root's data came with the round
    const void* from = rank_ == r.root_rank ? e->input : carried_parts_[0];
    if (from != target) std::memcpy(target, from, nbytes);
    tally->moved = nbytes;
    tally->activity = "CARRIED_BROADCAST";
    CountCarried();
    return Status::OK();
  }
  // MpiBackend::Bcast fills the root's output from its input (on one host beside the
  // others' copies).
  Status s = mpi_->Bcast(e ? e->input : target, target, nbytes, r.root_rank);
  tally->moved = nbytes;
  if (mpi_->hierarchical_broadcast()) counters_.hierarchical_collectives++;
  if (mpi_->ShmGathers()) {
    counters_.shm_collectives++;
    tally->activity = "SHM_BROADCAST";
  }
  return s;
}

void ProcessSetState::CountCarried() {
  counters_.carried_collectives++;
  if (mpi_->shared_memory()) counters_.shm_collectives++;  // not the direct round's
}

Status ProcessSetState::ReduceCarried(const Response& r, TensorEntry* e, const AllreduceOptions& options) {
  // As the shared-memory allreduce reduces (each element once, in rank order, then
  // postscaled and divided), so the same bits on every member.
  const int64_t n = NumElements(r.shape);
  ReduceElements(e->output, carried_parts_, n, options.dtype, options.reduce_op);
  ScaledCopy(e->output, e->output, n, options.dtype, options.postscale, options.divisor);
  return Status::OK();
}

Status ProcessSetState::ExecuteAlltoall(const Response& r, TensorEntry* e, OpOutput* out, OpTally* tally) {
  const int size = size_, me = rank_;
  int64_t row = RowElements(r.shape) * ElementSize(r.dtype);
  std::vector<int64_t> send(size), recv(size);
  int64_t total = 0;
  out->recv_splits.resize(size);
  for (int k = 0; k < size; ++k) {
    send[k] = r.splits[static_cast<size_t>(me) * size + k] * row;
    out->recv_splits[k] = r.splits[static_cast<size_t>(k) * size + me];
    recv[k] = out->recv_splits[k] * row;
    out->first_dim += out->recv_splits[k];
    total += recv[k];
  }
  out->Allocate(total);
  if (e && r.name == carried_) {  // every rank's input came with the round
    uint8_t* at = out->data.get();
    for (int k = 0; k < size; ++k) {
      int64_t skip = 0;  // rank k's rows for the ranks before this one
      for (int j = 0; j < me; ++j) skip += r.splits[static_cast<size_t>(k) * size + j] * row;
      std::memcpy(at, carried_ranks_[k] + skip, recv[k]);
      at += recv[k];
    }
    tally->moved = total;
    tally->sent_away = 0;
    for (int k = 0; k < size; ++k) tally->sent_away += k == me ? 0 : send[k];
    tally->activity = "CARRIED_ALLTOALL";
    CountCarried();
    return Status::OK();
  }
  // Through shared memory every rank's row of the matrix is needed, in bytes.
  std::vector<int64_t> matrix;
  if (mpi_->ShmGathers()) {
    for (int64_t rows : r.splits) matrix.push_back(rows * row);
  }
  Status s = mpi_->Alltoallv(e ? e->input : nullptr, send, out->data.get(), recv,
                             matrix.empty() ? nullptr : &matrix);
  tally->moved = total;
  tally->sent_away = 0;
  for (int k = 0; k < size; ++k) tally->sent_away += k == me ? 0 : send[k];
  if (mpi_->ShmGathers()) {
    counters_.shm_collectives++;
    tally->activity = "SHM_ALLTOALL";
  }
  return s;
}

Status ProcessSetState::ExecuteReducescatter(const Response& r, TensorEntry* e, OpTally* tally) {
  const int size = size_, me = rank_;
  const int elem = ElementSize(r.dtype);
  const std::vector<int64_t> counts = ScatterCounts(r.shape, size);
  const int64_t total = NumElements(r.shape);
  const bool average = r.reduce_op == HVDLITE_AVERAGE;
  Status s;
  if (r.name == carried_) {
    // Every rank's input came with the round, prescaled: this rank's shard of each,
    // reduced in rank order (the order of the shared-memory reduce-scatter).
    int64_t first = 0;
    for (int k = 0; k < me; ++k) first += counts[k];
    std::vector<const uint8_t*> shards(carried_parts_.size());
    for (size_t k = 0; k < shards.size(); ++k) shards[k] = carried_parts_[k] + first * elem;
    ReduceElements(e->output, shards, counts[me], r.dtype, average ? HVDLITE_SUM : r.reduce_op);
    tally->activity = "CARRIED_REDUCESCATTER";
    CountCarried();
  } else if (ReducescatterByLayers(r)) {
    // The whole input's allreduce over the layers (prescaled as a carried copy is), this
    // rank's rows of it: a carried copy's bits.
    int64_t first = 0;
    for (int k = 0; k < me; ++k) first += counts[k];
    uint8_t* in = fusion_.Get(2 * total * elem);  // the layered allreduce uses none
    uint8_t* reduced = in + total * elem;
    ScaledCopy(in, e->input, total, r.dtype, r.prescale, 1);
    AllreduceOptions options;
    options.dtype = r.dtype;
    options.reduce_op = average ? HVDLITE_SUM : r.reduce_op;
    s = mpi_->Allreduce({{in, reduced, total}}, options, Tuning(), &fusion_, [](const char*) {});
    if (s.ok() && counts[me] > 0) std::memcpy(e->output, reduced + first * elem, counts[me] * elem);
    tally->activity = "LAYERED_REDUCESCATTER";
  } else {
    const void* in = e->input;
    // MPI forbids aliased buffers: an in-place (or overlapping) call reduces a copy.
    auto in_at = reinterpret_cast<uintptr_t>(e->input);
    auto out_at = reinterpret_cast<uintptr_t>(e->output);
    bool overlap = total > 0 && counts[me] > 0 && out_at < in_at + total * elem &&
                   in_at < out_at + counts[me] * elem;
    if (r.prescale != 1.0 || overlap) {
      uint8_t* scratch = fusion_.Get(total * elem);
      ScaledCopy(scratch, e->input, total, r.dtype, r.prescale, 1);
      in = scratch;
    }
    s = mpi_->ReduceScatter(in, e->output, counts, r.dtype, average ? HVDLITE_SUM : r.reduce_op);
  }
  if (s.ok()) {
    ScaledCopy(e->output, e->output, counts[me], r.dtype, r.postscale,
               average ? std::max(1, r.contributors) : 1);
  }
  tally->moved = total * elem;
  if (mpi_->ShmGathers() && r.name != carried_) {
    counters_.shm_collectives++;
    tally->activity = "SHM_REDUCESCATTER";
  }
  return s;
}

}  // namespace hvdlite
