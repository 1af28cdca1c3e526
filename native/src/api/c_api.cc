// extern "C" shims over Core. No C++ exception crosses this boundary: each call
// catches, records the message in the calling thread's last-error slot, and returns
// a status code.
#include <cstring>
#include <exception>
#include <string>

#include "core/core.h"
#include "backend/backend_mpi.h"
#include "gpu/cuda_api.h"
#include "transport/mpi_fault_guard.h"

#define HVDLITE_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

thread_local std::string g_last_error;

hvdlite_status_t Record(const hvdlite::Status& s) {
  if (!s.ok()) g_last_error = s.message();
  return s.code();
}

template <typename F>
hvdlite_status_t Guard(F&& f) {
  try {
    return Record(f());
  } catch (const std::bad_alloc&) {
    return Record(hvdlite::Status(HVDLITE_ERR_INTERNAL, "out of memory"));
  } catch (const std::exception& e) {
    return Record(hvdlite::Status(HVDLITE_ERR_INTERNAL, std::string("internal error: ") + e.what()));
  }
}

hvdlite::Status NullOut() { return hvdlite::InvalidArgument("output pointer is NULL"); }

template <typename Getter>
hvdlite_status_t Topology(int32_t* out, Getter get) {
  return Guard([&] {
    if (!out) return NullOut();
    hvdlite::Core& core = hvdlite::Core::Get();
    hvdlite::Status s = core.CheckRunning();
    if (s.ok()) *out = get(core.topology());
    return s;
  });
}

}  // namespace

namespace hvdlite {
// For testing_api.cc: records s as the calling thread's last error; returns its code.
hvdlite_status_t RecordStatus(const Status& s) { return Record(s); }
}  // namespace hvdlite

HVDLITE_EXPORT hvdlite_status_t hvdlite_init(const hvdlite_init_options_t* options) {
  return Guard([&] { return hvdlite::Core::Get().Init(options ? options->comm_f2c : -1); });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_shutdown(void) {
  return Guard([] { return hvdlite::Core::Get().Shutdown(); });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_note_lost_peers(const char* notice) {
  hvdlite::NoteLostPeers(notice);
  return HVDLITE_OK;
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_is_initialized(int32_t* out) {
  return Guard([&] {
    if (!out) return NullOut();
    *out = hvdlite::Core::Get().initialized() ? 1 : 0;
    return hvdlite::Status::OK();
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_rank(int32_t* out) {
  return Topology(out, [](const hvdlite::MpiTopology& t) { return t.rank; });
}
HVDLITE_EXPORT hvdlite_status_t hvdlite_size(int32_t* out) {
  return Topology(out, [](const hvdlite::MpiTopology& t) { return t.size; });
}
HVDLITE_EXPORT hvdlite_status_t hvdlite_local_rank(int32_t* out) {
  return Topology(out, [](const hvdlite::MpiTopology& t) { return t.local_rank; });
}
HVDLITE_EXPORT hvdlite_status_t hvdlite_local_size(int32_t* out) {
  return Topology(out, [](const hvdlite::MpiTopology& t) { return t.local_size; });
}
HVDLITE_EXPORT hvdlite_status_t hvdlite_cross_rank(int32_t* out) {
  return Topology(out, [](const hvdlite::MpiTopology& t) { return t.cross_rank; });
}
HVDLITE_EXPORT hvdlite_status_t hvdlite_cross_size(int32_t* out) {
  return Topology(out, [](const hvdlite::MpiTopology& t) { return t.cross_size; });
}
HVDLITE_EXPORT hvdlite_status_t hvdlite_mpi_threads_supported(int32_t* out) {
  return Topology(out, [](const hvdlite::MpiTopology& t) { return t.threads_multiple ? 1 : 0; });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_enqueue(const hvdlite_tensor_t* tensor, hvdlite_handle_t* out) {
  return Guard([&] { return hvdlite::Core::Get().Enqueue(tensor, 1, false, out); });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_enqueue_buffers(const hvdlite_tensor_t* tensor,
                                                        const void* input, void* output,
                                                        hvdlite_handle_t* out) {
  return Guard([&] {
    if (!tensor) return hvdlite::InvalidArgument("tensor is NULL");
    hvdlite_tensor_t t = *tensor;
    t.input = input;
    t.output = output;
    return hvdlite::Core::Get().Enqueue(&t, 1, false, out);
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_enqueue_buffers_wait(const hvdlite_tensor_t* tensor,
                                                             const void* input, void* output,
                                                             double timeout_s, int32_t release,
                                                             hvdlite_handle_t* out,
                                                             hvdlite_status_t* op_status) {
  return Guard([&] {
    if (!tensor) return hvdlite::InvalidArgument("tensor is NULL");
    if (!op_status) return NullOut();
    hvdlite_tensor_t t = *tensor;
    t.input = input;
    t.output = output;
    hvdlite::Status op;
    hvdlite::Status s = hvdlite::Core::Get().EnqueueAndWait(&t, timeout_s, release != 0, out, &op);
    if (s.ok()) {
      *op_status = op.code();
      if (!op.ok()) Record(op);  // the op's message, for hvdlite_last_error
    }
    return s;
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_enqueue_wait_take(const hvdlite_tensor_t* tensor,
                                                          const void* input, double timeout_s,
                                                          void* dst, int64_t capacity,
                                                          int64_t* nbytes, int64_t* first_dim,
                                                          int64_t* recv_splits,
                                                          hvdlite_handle_t* out,
                                                          hvdlite_status_t* op_status) {
  return Guard([&] {
    if (!tensor) return hvdlite::InvalidArgument("tensor is NULL");
    if (!op_status || !nbytes || !first_dim || !out || (!dst && capacity > 0)) return NullOut();
    hvdlite_tensor_t t = *tensor;
    t.input = input;
    t.output = nullptr;
    *nbytes = -1;
    hvdlite::Status op;
    hvdlite::Status s = hvdlite::Core::Get().EnqueueAndWait(&t, timeout_s, false, out, &op);
    if (!s.ok()) return s;
    *op_status = op.code();
    if (!op.ok()) {
      Record(op);  // the op's message, for hvdlite_last_error
      return hvdlite::Status::OK();
    }
    return hvdlite::Core::Get().handles().TakeOutput(*out, dst, capacity, nbytes, first_dim,
                                                     recv_splits);
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_enqueue_group(const hvdlite_tensor_t* tensors, int32_t n,
                                                      hvdlite_handle_t* handles) {
  return Guard([&] { return hvdlite::Core::Get().Enqueue(tensors, n, true, handles); });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_leave_join(void) {
  return Guard([&] { return hvdlite::Core::Get().LeaveJoin(); });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_refuse(hvdlite_op_t op, const char* name,
                                               int32_t process_set_id, const char* reason) {
  return Guard([&] {
    return hvdlite::Core::Get().Refuse(op, name, process_set_id, reason ? reason : "");
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_poll(hvdlite_handle_t handle, int32_t* done) {
  return Guard([&] {
    if (!done) return NullOut();
    bool d = false;
    hvdlite::Status s = hvdlite::Core::Get().handles().Poll(handle, &d);
    *done = d ? 1 : 0;
    return s;
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_wait(hvdlite_handle_t handle, double timeout_s) {
  return Guard([&] { return hvdlite::Core::Get().Wait(handle, timeout_s, false); });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_wait_release(hvdlite_handle_t handle, double timeout_s) {
  return Guard([&] { return hvdlite::Core::Get().Wait(handle, timeout_s, true); });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_release_ended(const hvdlite_handle_t* handles, int32_t n,
                                                      int32_t* released) {
  return Guard([&] {
    if (!released || (n > 0 && !handles)) return NullOut();
    *released = n > 0 ? hvdlite::Core::Get().handles().ReleaseEnded(handles, n) : 0;
    return hvdlite::Status::OK();
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_handle_output(hvdlite_handle_t handle, void** data,
                                                      int64_t* nbytes, int64_t* first_dim) {
  return Guard([&] {
    if (!data || !nbytes || !first_dim) return NullOut();
    return hvdlite::Core::Get().handles().Output(handle, data, nbytes, first_dim);
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_handle_recv_splits(hvdlite_handle_t handle, int64_t* splits) {
  return Guard([&] {
    if (!splits) return NullOut();
    std::vector<int64_t> v;
    hvdlite::Status s = hvdlite::Core::Get().handles().RecvSplits(handle, &v);
    if (s.ok()) std::copy(v.begin(), v.end(), splits);
    return s;
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_handle_take_output(hvdlite_handle_t handle, void* dst,
                                                           int64_t capacity, int64_t* nbytes,
                                                           int64_t* first_dim,
                                                           int64_t* recv_splits) {
  return Guard([&] {
    if (!nbytes || !first_dim || (!dst && capacity > 0)) return NullOut();
    return hvdlite::Core::Get().handles().TakeOutput(handle, dst, capacity, nbytes, first_dim,
                                                     recv_splits);
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_release(hvdlite_handle_t handle) {
  return Guard([&] { return hvdlite::Core::Get().handles().Release(handle); });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_stats(hvdlite_stats_t* out) {
  return Guard([&] {
    if (!out) return NullOut();
    const hvdlite::Counters& c = hvdlite::Core::Get().counters();
    out->cycles = c.cycles;
    out->coordinator_gathers = c.coordinator_gathers;
    out->cache_hits = c.cache_hits;
    out->cache_misses = c.cache_misses;
    out->collectives = c.collectives;
    out->fused_collectives = c.fused_collectives;
    out->tensors = c.tensors;
    out->bytes = c.bytes;
    out->errors = c.errors;
    out->shm_collectives = c.shm_collectives;
    out->wire_bytes = c.wire_bytes;
    out->hierarchical_collectives = c.hierarchical_collectives;
    out->nccl_collectives = c.nccl_collectives;
    out->staged_collectives = c.staged_collectives;
    out->nccl_us = c.nccl_us;
    out->waiting_threads = hvdlite::Core::Get().handles().blocked().load();
    out->caller_cycles = c.caller_cycles;
    out->carried_collectives = c.carried_collectives;
    return hvdlite::Status::OK();
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_gpu_support(int32_t* cuda_runtime_version, int32_t* nccl_version) {
  return Guard([&] {
    if (!cuda_runtime_version || !nccl_version) return NullOut();
    std::string error;
    const hvdlite::gpu::CudaApi* cuda = hvdlite::gpu::Cuda(&error);
    const hvdlite::gpu::NcclApi* nccl = hvdlite::gpu::Nccl(&error);
    *cuda_runtime_version = cuda ? cuda->version : 0;
    *nccl_version = nccl ? nccl->version : 0;
    return hvdlite::Status::OK();
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_autotune_state(hvdlite_autotune_t* out) {
  return Guard([&] {
    if (!out) return NullOut();
    const hvdlite::AutotuneView v = hvdlite::Core::Get().autotune().View();
    out->enabled = v.enabled;
    out->settled = v.settled;
    out->trials = v.trials;
    out->fusion_threshold = v.knobs.fusion_threshold;
    out->cycle_time_ms = v.knobs.cycle_time_ms;
    out->shm_chunk_bytes = v.knobs.shm_chunk_bytes;
    out->hierarchical = v.knobs.hierarchical;
    return hvdlite::Status::OK();
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_add_process_set(const int32_t* ranks, int32_t n, int32_t* id) {
  return Guard([&] {
    if (!id) return NullOut();
    return hvdlite::Core::Get().AddProcessSet(ranks, n, id);
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_remove_process_set(int32_t id) {
  return Guard([&] { return hvdlite::Core::Get().RemoveProcessSet(id); });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_process_set_ids(int32_t* ids, int32_t capacity, int32_t* n) {
  return Guard([&] {
    if (!n || (capacity > 0 && !ids)) return NullOut();
    hvdlite::Core& core = hvdlite::Core::Get();
    hvdlite::Status s = core.CheckRunning();
    if (!s.ok()) return s;
    auto sets = core.ProcessSets();
    *n = static_cast<int32_t>(sets.size());
    for (int32_t i = 0; i < *n && i < capacity; ++i) ids[i] = sets[i]->id;
    return hvdlite::Status::OK();
  });
}

namespace {
// The members of set id for the calls below (an error when not running or unknown).
hvdlite::Status Members(int32_t id, std::shared_ptr<const hvdlite::ProcessSetMembers>* out) {
  hvdlite::Core& core = hvdlite::Core::Get();
  hvdlite::Status s = core.CheckRunning();
  return s.ok() ? core.ProcessSet(id, out) : s;
}
}  // namespace

HVDLITE_EXPORT hvdlite_status_t hvdlite_process_set_ranks(int32_t id, int32_t* ranks, int32_t capacity,
                                                          int32_t* n) {
  return Guard([&] {
    if (!n || (capacity > 0 && !ranks)) return NullOut();
    std::shared_ptr<const hvdlite::ProcessSetMembers> set;
    hvdlite::Status s = Members(id, &set);
    if (!s.ok()) return s;
    *n = set->size();
    for (int32_t i = 0; i < *n && i < capacity; ++i) ranks[i] = set->ranks[i];
    return s;
  });
}

namespace {
// A query of one number about set id, like Topology's.
template <typename Getter>
hvdlite_status_t SetQuery(int32_t id, int32_t* out, Getter get) {
  return Guard([&] {
    if (!out) return NullOut();
    std::shared_ptr<const hvdlite::ProcessSetMembers> set;
    hvdlite::Status s = Members(id, &set);
    if (s.ok()) *out = get(*set);
    return s;
  });
}
}  // namespace

HVDLITE_EXPORT hvdlite_status_t hvdlite_process_set_rank(int32_t id, int32_t* out) {
  return SetQuery(id, out, [](const hvdlite::ProcessSetMembers& m) { return m.rank; });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_process_set_size(int32_t id, int32_t* out) {
  return SetQuery(id, out, [](const hvdlite::ProcessSetMembers& m) { return m.size(); });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_start_timeline(const char* path, int32_t mark_cycles) {
  return Guard([&] {
    if (!path || !*path) return hvdlite::InvalidArgument("timeline path is empty");
    return hvdlite::Core::Get().StartTimeline(path, mark_cycles != 0);
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_stop_timeline(void) {
  return Guard([] { return hvdlite::Core::Get().StopTimeline(); });
}

HVDLITE_EXPORT const char* hvdlite_last_error(void) { return g_last_error.c_str(); }

HVDLITE_EXPORT const char* hvdlite_status_name(hvdlite_status_t status) {
  switch (status) {
    case HVDLITE_OK: return "HVDLITE_OK";
    case HVDLITE_ERR_NOT_INITIALIZED: return "HVDLITE_ERR_NOT_INITIALIZED";
    case HVDLITE_ERR_INVALID_ARGUMENT: return "HVDLITE_ERR_INVALID_ARGUMENT";
    case HVDLITE_ERR_DUPLICATE_NAME: return "HVDLITE_ERR_DUPLICATE_NAME";
    case HVDLITE_ERR_MISMATCH: return "HVDLITE_ERR_MISMATCH";
    case HVDLITE_ERR_SHUTDOWN: return "HVDLITE_ERR_SHUTDOWN";
    case HVDLITE_ERR_STALLED: return "HVDLITE_ERR_STALLED";
    case HVDLITE_ERR_MPI: return "HVDLITE_ERR_MPI";
    case HVDLITE_ERR_INVALID_HANDLE: return "HVDLITE_ERR_INVALID_HANDLE";
    case HVDLITE_ERR_IN_PROGRESS: return "HVDLITE_ERR_IN_PROGRESS";
    case HVDLITE_ERR_ALREADY_INITIALIZED: return "HVDLITE_ERR_ALREADY_INITIALIZED";
    case HVDLITE_ERR_TIMEOUT: return "HVDLITE_ERR_TIMEOUT";
    case HVDLITE_ERR_RANK_FAILED: return "HVDLITE_ERR_RANK_FAILED";
    case HVDLITE_ERR_INTERNAL: return "HVDLITE_ERR_INTERNAL";
    case HVDLITE_ERR_ABORTED: return "HVDLITE_ERR_ABORTED";
    default: return "HVDLITE_ERR_UNKNOWN";
  }
}

HVDLITE_EXPORT const char* hvdlite_version(void) { return "0.1.0"; }

HVDLITE_EXPORT hvdlite_status_t hvdlite_mpi_library_version(char* buf, int32_t len) {
  return Guard([&] {
    if (!buf || len <= 0) return NullOut();
    std::string v = hvdlite::MpiBackend::LibraryVersion();
    std::strncpy(buf, v.c_str(), len - 1);
    buf[len - 1] = '\0';
    return hvdlite::Status::OK();
  });
}
