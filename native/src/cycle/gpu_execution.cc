// Execution of GPU tensors (a run of ready responses whose tensors are in GPU memory on
// every rank; negotiation refuses a mix). Background thread only.
//
// Each process set decides once, with all its members, how its GPU tensors travel
// (DecideGpuPath): through NCCL when every member opened NCCL and no two members share
// a GPU (NCCL runs one rank per GPU), else staged through pinned host memory into the
// same CPU paths as host tensors (shared memory or MPI). HVDLITE_GPU_OPERATIONS=NCCL|MPI
// forces one. The decision is the same on every member, and so is each run's path: it
// depends only on the responses, which are identical everywhere.
//
// Ops NCCL cannot do exactly as the CPU paths do (integer Average and scaling, dtypes
// NCCL lacks, joined ranks) are staged even on an NCCL set. Allgather and alltoall,
// whose results the core allocates in host memory (c_api.h), end with one copy of the
// gathered result to the host; the adapter moves it to the tensor's GPU.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>

#include "cycle/process_set.h"

namespace hvdlite {
namespace {

bool Floating(int32_t dtype) {
  return dtype == HVDLITE_FLOAT16 || dtype == HVDLITE_BFLOAT16 || dtype == HVDLITE_FLOAT32 ||
         dtype == HVDLITE_FLOAT64;
}

bool AnyJoined(const Response& r) { return std::find(r.joined.begin(), r.joined.end(), 1) != r.joined.end(); }

// Staging keeps each tensor's bytes at a 64-byte boundary of the pinned buffer.
int64_t Aligned(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// What one member tells the others when the set decides its GPU path.
struct GpuRecord {
  char gpu_ok;
  char nccl_ok;
  char identity[254];  // host/PCI bus id of its GPU
};

}  // namespace

Status ProcessSetState::DecideGpuPath(int device) {
  GpuRecord mine;
  std::memset(&mine, 0, sizeof(mine));
  Status own = device >= 0 ? gpu_.Use(device)
               : gpu_.ready() ? Status::OK()
                              : InvalidArgument("this rank has no GPU tensor in the op");
  std::string nccl_error;
  const gpu::NcclApi* nccl = nullptr;
  if (own.ok() && config_.gpu_operations != Config::GpuOperations::kStaged) nccl = gpu::Nccl(&nccl_error);
  mine.gpu_ok = own.ok();
  mine.nccl_ok = nccl != nullptr;
  if (own.ok()) std::snprintf(mine.identity, sizeof(mine.identity), "%s", gpu_.identity().c_str());
  std::vector<GpuRecord> all(size_);
  Status s = mpi_->Allgatherv(&mine, sizeof(mine), all.data(), std::vector<int64_t>(size_, sizeof(GpuRecord)));
  if (!s.ok()) return s;

  // From here on every member reads the same records and decides alike.
  std::vector<int> no_gpu, no_nccl;
  std::map<std::string, std::vector<int>> by_gpu;
  for (int k = 0; k < size_; ++k) {
    const int global = members_->ranks[k];
    if (!all[k].gpu_ok) no_gpu.push_back(global);
    if (!all[k].nccl_ok) no_nccl.push_back(global);
    if (all[k].gpu_ok) by_gpu[std::string(all[k].identity, strnlen(all[k].identity, sizeof(all[k].identity)))].push_back(global);
  }
  const std::string where = "GPU tensors" + members_->Where();
  if (!no_gpu.empty()) {
    gpu_path_ = GpuPath::kFailed;
    gpu_path_error_ = where + " cannot run: " + RankList(no_gpu) + " could not use a GPU" +
                      (own.ok() ? "" : " (here: " + own.message() + ")");
    return Status::OK();
  }
  std::string shared;  // why NCCL cannot serve this set, if it cannot
  for (const auto& [identity, ranks] : by_gpu) {
    if (ranks.size() > 1 && shared.empty()) {
      shared = RankList(ranks) + " share the GPU " + identity + " (NCCL runs one rank per GPU)";
    }
  }
  if (shared.empty() && !no_nccl.empty()) {
    shared = RankList(no_nccl) + " could not open NCCL" + (nccl_error.empty() ? "" : " (here: " + nccl_error + ")");
  }
  std::string how;
  if (config_.gpu_operations == Config::GpuOperations::kStaged) {
    gpu_path_ = GpuPath::kStaged;
    how = "staged through host memory (HVDLITE_GPU_OPERATIONS=MPI)";
  } else if (shared.empty()) {
    s = nccl_.Init(nccl, &gpu_, rank_, size_, [this](void* id, int64_t bytes) { return mpi_->Bcast(id, id, bytes, 0); });
    if (!s.ok()) {
      gpu_path_ = GpuPath::kFailed;
      gpu_path_error_ = where + " cannot run: " + s.message();
      return Status::OK();
    }
    gpu_path_ = GpuPath::kNccl;
    how = "through " + gpu::Describe(*nccl) + ", fused tensors packed with " + gpu_.PackMethod();
  } else if (config_.gpu_operations == Config::GpuOperations::kNccl) {
    gpu_path_ = GpuPath::kFailed;
    gpu_path_error_ = where + " cannot run through NCCL, which HVDLITE_GPU_OPERATIONS=NCCL asks for: " + shared +
                      "; unset it to stage them through host memory";
  } else {
    gpu_path_ = GpuPath::kStaged;
    how = "staged through host memory: " + shared;
  }
  if (rank_ == 0) {
    if (gpu_path_ == GpuPath::kFailed) {
      HVDLITE_LOG(WARNING) << gpu_path_error_;
    } else {
      HVDLITE_LOG(INFO) << where << ": " << how;
    }
  }
  return Status::OK();
}

bool ProcessSetState::NcclCanRun(const Response& r) const {
  if (AnyJoined(r)) return false;
  switch (r.op) {
    case HVDLITE_OP_ALLREDUCE:
    case HVDLITE_OP_REDUCESCATTER: {
      if (gpu::NcclType(r.dtype) < 0) return false;
      const bool scaled = r.prescale != 1.0 || r.postscale != 1.0 || r.reduce_op == HVDLITE_AVERAGE;
      if (!scaled) return gpu::NcclReduction(r.reduce_op) >= 0;
      // A scaled sum multiplies in the tensor's type: exact for floating types only.
      return Floating(r.dtype) && (r.reduce_op == HVDLITE_SUM || r.reduce_op == HVDLITE_AVERAGE);
    }
    case HVDLITE_OP_BROADCAST:
    case HVDLITE_OP_ALLGATHER:
    case HVDLITE_OP_ALLTOALL:
      return true;
  }
  return false;
}

void ProcessSetState::ExecuteOnDevice(const std::vector<Response>& ready, size_t begin, size_t end) {
  std::vector<const Response*> run;
  for (size_t k = begin; k < end; ++k) run.push_back(&ready[k]);
  std::vector<TensorEntry*> entries =
      queue_.FindAll(run, [](const Response* r) -> const std::string& { return r->name; });
  if (gpu_path_ == GpuPath::kUndecided) {
    int device = -1;
    for (TensorEntry* e : entries) {
      if (e && e->request.device >= 0) device = e->request.device;
    }
    Status s = DecideGpuPath(device);
    if (!s.ok()) {
      FinishAll(entries, s);
      EndLoop(s);
      return;
    }
  }
  if (gpu_path_ == GpuPath::kFailed) {
    if (timeline_.active()) {
      for (const Response* r : run) timeline_.End(r->name);
    }
    FinishAll(entries, Status(HVDLITE_ERR_INVALID_ARGUMENT, gpu_path_error_));
    return;
  }
  if (gpu_path_ == GpuPath::kNccl &&
      std::all_of(run.begin(), run.end(), [this](const Response* r) { return NcclCanRun(*r); })) {
    Status s = RunOnNccl(run, entries);
    if (!s.ok()) EndLoop(s);
    return;
  }
  // An allreduce copies its inputs down piece by piece itself (AllreduceStaged).
  Status s = StageIn(run, entries, run[0]->op != HVDLITE_OP_ALLREDUCE);
  if (!s.ok()) {
    staged_.clear();
    FinishAll(entries, s);
    EndLoop(s);
    return;
  }
  // The host tensors' path, unchanged: Finish copies the results back.
  counters_.staged_collectives++;
  const Response& r = *run[0];
  if (r.op == HVDLITE_OP_ALLGATHER && run.size() > 1) {
    ExecuteFusedAllgather(run);
  } else if (r.op != HVDLITE_OP_ALLREDUCE) {
    ExecuteOne(r);
  } else {
    ExecuteAllreduce(run);
  }
  staged_.clear();
}

// Points each entry at pinned host memory, its input copied there (unless the caller
// copies: copy_inputs false); outputs the caller gave (allreduce, broadcast,
// reducescatter) get host memory too, copied back by StageOut.
Status ProcessSetState::StageIn(const std::vector<const Response*>& run, const std::vector<TensorEntry*>& entries,
                                bool copy_inputs) {
  staged_.clear();
  std::vector<int64_t> in_bytes(entries.size(), 0), out_bytes(entries.size(), 0);
  int64_t total = 0;
  for (size_t k = 0; k < entries.size(); ++k) {
    TensorEntry* e = entries[k];
    if (!e) continue;
    const int32_t op = run[k]->op;
    const int elem = ElementSize(e->request.dtype);
    in_bytes[k] = NumElements(e->request.shape) * elem;
    if (op == HVDLITE_OP_REDUCESCATTER) {
      out_bytes[k] = ScatterCounts(e->request.shape, size_)[rank_] * elem;
    } else if (op == HVDLITE_OP_ALLREDUCE || op == HVDLITE_OP_BROADCAST) {
      out_bytes[k] = in_bytes[k];
    }
    total += Aligned(in_bytes[k]) + (op == HVDLITE_OP_REDUCESCATTER ? Aligned(out_bytes[k]) : 0);
  }
  uint8_t* host = nullptr;
  Status s = gpu_.Pinned(std::max<int64_t>(total, 64), &host);
  int64_t at = 0;
  const void* waited = nullptr;
  for (size_t k = 0; k < entries.size() && s.ok(); ++k) {
    TensorEntry* e = entries[k];
    if (!e) continue;
    uint8_t* host_in = host + at;
    at += Aligned(in_bytes[k]);
    uint8_t* host_out = out_bytes[k] > 0 ? host_in : nullptr;  // allreduce, broadcast: in place
    if (run[k]->op == HVDLITE_OP_REDUCESCATTER) {
      host_out = host + at;
      at += Aligned(out_bytes[k]);
    }
    if (e->ready_event != waited) s = gpu_.WaitFor(e->ready_event);  // a group's: once
    waited = e->ready_event;
    if (s.ok() && copy_inputs) s = gpu_.Copy(host_in, e->input, in_bytes[k]);
    if (!s.ok()) break;
    staged_.push_back({e, e->input, e->output, out_bytes[k]});
    e->input = host_in;
    e->output = host_out;
  }
  return s.ok() && copy_inputs ? gpu_.Finish() : s;
}

// The chunks run as a pipeline on the core's one stream, which does its copies in the
// order given: chunk c+2 is sent down right after chunk c's result is sent up, so while
// the host reduces chunk c the stream brings chunk c+1 down and then takes chunk c's
// result up. Every rank cuts the same chunks (from the responses' shapes alone), so
// each chunk is one collective on every rank, a joined rank's zeros included.
Status ProcessSetState::AllreduceStaged(const std::vector<TensorEntry*>& entries,
                                        const std::vector<ShmCollectives::Piece>& pieces,
                                        const AllreduceOptions& options, const AllreduceTuning& tuning,
                                        const std::function<void(const char*)>& step) {
  const int64_t elem = ElementSize(options.dtype);
  int64_t total = 0;
  for (const ShmCollectives::Piece& p : pieces) total += p.count;
  const int64_t chunk = config_.gpu_stage_chunk > 0 ? std::max<int64_t>(1, config_.gpu_stage_chunk / elem)
                                                   : std::max<int64_t>(1, total);
  struct Chunk {
    std::vector<ShmCollectives::Piece> pieces;
    std::vector<gpu::Device::Span> down, up;
  };
  std::vector<Chunk> chunks(static_cast<size_t>(std::max<int64_t>(1, (total + chunk - 1) / chunk)));
  size_t staged = 0;  // staged_ holds the non-null entries, in order
  int64_t at = 0;     // elements before pieces[k]
  for (size_t k = 0; k < pieces.size(); ++k) {
    const ShmCollectives::Piece& p = pieces[k];
    Staged* st = entries[k] ? &staged_[staged++] : nullptr;
    if (p.count == 0) chunks[std::min(chunks.size() - 1, static_cast<size_t>(at / chunk))].pieces.push_back(p);
    for (int64_t from = 0; from < p.count;) {
      const size_t c = static_cast<size_t>((at + from) / chunk);
      const int64_t n = std::min(p.count - from, static_cast<int64_t>(c + 1) * chunk - (at + from));
      const int64_t off = from * elem;
      auto* in = p.in ? static_cast<const uint8_t*>(p.in) + off : nullptr;
      auto* out = p.out ? static_cast<uint8_t*>(p.out) + off : nullptr;
      chunks[c].pieces.push_back({in, out, n});
      if (st) {
        chunks[c].down.push_back({const_cast<uint8_t*>(in), static_cast<const uint8_t*>(st->device_input) + off, n * elem});
        chunks[c].up.push_back({static_cast<uint8_t*>(st->device_output) + off, out, n * elem});
      }
      from += n;
    }
    at += p.count;
  }
  const bool copies = staged > 0;
  auto send_down = [&](size_t c) {
    Status s;
    for (const gpu::Device::Span& d : chunks[c].down) {
      if (s.ok()) s = gpu_.Copy(d.dst, d.src, d.bytes);
    }
    return s.ok() && copies ? gpu_.Mark(static_cast<int>(c % gpu::Device::kMarks)) : s;
  };
  Status s;
  for (size_t c = 0; c < std::min<size_t>(2, chunks.size()) && s.ok(); ++c) s = send_down(c);
  for (size_t c = 0; c < chunks.size() && s.ok(); ++c) {
    if (copies) s = gpu_.WaitForMark(static_cast<int>(c % gpu::Device::kMarks));
    if (s.ok()) s = mpi_->Allreduce(chunks[c].pieces, options, tuning, &fusion_, step);
    for (const gpu::Device::Span& u : chunks[c].up) {
      if (s.ok()) s = gpu_.Copy(u.dst, u.src, u.bytes);
    }
    if (s.ok() && c + 2 < chunks.size()) s = send_down(c + 2);
  }
  // Nothing may still be copying once the handles complete, also after a failure.
  if (copies) {
    Status f = gpu_.Finish();
    if (s.ok()) s = f;
  }
  for (Staged& st : staged_) st.output_bytes = 0;  // the results are up (or failed)
  return s;
}

Status ProcessSetState::StageOut(const std::vector<TensorEntry*>& entries, const Status& status) {
  Status result = status;
  Status* s = &result;
  bool copied = false;
  for (TensorEntry* e : entries) {
    if (!e) continue;
    for (Staged& st : staged_) {
      if (st.entry != e) continue;
      if (s->ok() && st.output_bytes > 0) {
        Status c = gpu_.Copy(st.device_output, e->output, st.output_bytes);
        copied = true;
        if (!c.ok()) *s = c;
      }
      st.entry = nullptr;
      break;
    }
  }
  if (copied) {
    Status f = gpu_.Finish();
    if (s->ok() && !f.ok()) *s = f;
  }
  return result;
}

Status ProcessSetState::RunOnNccl(const std::vector<const Response*>& run, const std::vector<TensorEntry*>& entries) {
  const Response& r = *run[0];
  const int elem = ElementSize(r.dtype);
  const auto start = std::chrono::steady_clock::now();
  Status s;
  const void* waited = nullptr;  // a group's tensors share one event: waited once
  for (TensorEntry* e : entries) {
    if (s.ok() && e && e->ready_event != waited) {
      s = gpu_.WaitFor(e->ready_event);
      waited = e->ready_event;
    }
  }
  const bool average = r.reduce_op == HVDLITE_AVERAGE;
  const double scale = r.prescale * r.postscale / (average ? std::max(1, r.contributors) : 1);
  const int32_t reduce_op = average ? HVDLITE_SUM : r.reduce_op;
  int64_t moved = 0;
  std::vector<OpOutput> outs(run.size());
  if (s.ok() && r.op == HVDLITE_OP_ALLREDUCE) {
    int64_t count = 0;
    for (const Response* f : run) count += NumElements(f->shape);
    moved = count * elem;
    if (entries.size() == 1) {
      s = nccl_.Allreduce(entries[0]->input, entries[0]->output, count, r.dtype, reduce_op, scale);
    } else {
      // Fused: the tensors packed into the device buffer, reduced there, unpacked.
      uint8_t* buf = nullptr;
      s = gpu_.Scratch(std::max<int64_t>(moved, 64), &buf);
      std::vector<gpu::Device::Span> pack, unpack;
      int64_t at = 0;
      for (size_t k = 0; k < entries.size(); ++k) {
        const int64_t n = NumElements(run[k]->shape) * elem;
        pack.push_back({buf + at, entries[k]->input, n});
        unpack.push_back({entries[k]->output, buf + at, n});
        at += n;
      }
      if (s.ok()) s = gpu_.CopyOnDevice(pack);
      if (s.ok()) s = nccl_.Allreduce(buf, buf, count, r.dtype, reduce_op, scale);
      if (s.ok()) s = gpu_.CopyOnDevice(unpack);
    }
  } else if (s.ok() && r.op == HVDLITE_OP_BROADCAST) {
    TensorEntry* e = entries[0];
    moved = NumElements(r.shape) * elem;
    if (rank_ == r.root_rank) s = gpu_.Copy(e->output, e->input, moved);
    if (s.ok()) s = nccl_.Broadcast(e->output, moved, r.root_rank);
  } else if (s.ok() && r.op == HVDLITE_OP_REDUCESCATTER) {
    TensorEntry* e = entries[0];
    const std::vector<int64_t> counts = ScatterCounts(r.shape, size_);
    moved = NumElements(r.shape) * elem;
    const void* in = e->input;
    auto in_at = reinterpret_cast<uintptr_t>(e->input), out_at = reinterpret_cast<uintptr_t>(e->output);
    if (moved > 0 && out_at < in_at + moved && in_at < out_at + counts[rank_] * elem) {
      uint8_t* copy = nullptr;  // the output overlaps the input: reduce a copy
      s = gpu_.Scratch(moved, &copy);
      if (s.ok()) s = gpu_.Copy(copy, e->input, moved);
      in = copy;
    }
    if (s.ok()) s = nccl_.ReduceScatter(in, e->output, counts, r.dtype, reduce_op, scale);
  } else if (s.ok()) {
    // Allgather (one or several) and alltoall: gathered on the device, then one copy of
    // each result to the host buffer the handle owns.
    for (size_t t = 0; t < run.size() && s.ok(); ++t) {
      const Response& f = *run[t];
      TensorEntry* e = entries[t];
      const int64_t row = RowElements(f.shape) * elem;
      std::vector<int64_t> send(size_, 0), recv(size_, 0);
      int64_t total = 0;
      for (int k = 0; k < size_; ++k) {
        if (f.op == HVDLITE_OP_ALLGATHER) {
          send[k] = f.first_dims[rank_] * row;
          recv[k] = f.first_dims[k] * row;
          outs[t].first_dim += f.first_dims[k];
        } else {
          send[k] = f.splits[static_cast<size_t>(rank_) * size_ + k] * row;
          outs[t].recv_splits.push_back(f.splits[static_cast<size_t>(k) * size_ + rank_]);
          recv[k] = outs[t].recv_splits.back() * row;
          outs[t].first_dim += outs[t].recv_splits.back();
        }
        total += recv[k];
      }
      uint8_t* buf = nullptr;
      s = gpu_.Scratch(std::max<int64_t>(total, 64), &buf);
      if (s.ok()) {
        s = f.op == HVDLITE_OP_ALLGATHER ? nccl_.Allgather(e->input, buf, recv) : nccl_.Alltoall(e->input, send, buf, recv);
      }
      outs[t].Allocate(total);
      if (s.ok()) s = gpu_.Copy(outs[t].data.get(), buf, total);
      // The next tensor reuses the device buffer: this one's result must be out first.
      if (s.ok()) s = gpu_.Finish();
      moved += total;
    }
  }
  if (s.ok()) s = gpu_.Finish();
  if (timeline_.active()) {
    for (const Response* f : run) timeline_.End(f->name);
  }
  counters_.nccl_us += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count();
  counters_.collectives++;
  counters_.nccl_collectives++;
  if (run.size() > 1) counters_.fused_collectives++;
  counters_.bytes += moved;
  counters_.wire_bytes += r.op == HVDLITE_OP_ALLTOALL ? 0 : WireBytes(r.op, moved, size_);
  if (r.op == HVDLITE_OP_ALLGATHER || r.op == HVDLITE_OP_ALLTOALL) {
    for (size_t t = 0; t < run.size(); ++t) Finish(entries[t], s, std::move(outs[t]));
  } else {
    FinishAll(entries, s);
  }
  return s;
}

}  // namespace hvdlite
