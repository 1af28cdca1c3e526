// Test-only entry points (native/include/hvdlite/testing.h): the wire format and the
// coordinator, driven without MPI. Called from any thread; the controller table is
// guarded by its own mutex, and one simulated controller must not be driven from two
// threads at once (tests do not).
#include "hvdlite/testing.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cycle/autotune.h"
#include "cycle/controller.h"
#include "cycle/message.h"
#include "transport/mpi_fault_guard.h"
#include "transport/shm_collectives.h"
#include "cycle/tensor_queue.h"
#include "cycle/timeline.h"

#define HVDLITE_EXPORT extern "C" __attribute__((visibility("default")))

namespace hvdlite {
hvdlite_status_t RecordStatus(const Status& s);  // c_api.cc
}  // namespace hvdlite

namespace hvdlite {
namespace {

template <typename F>
hvdlite_status_t Guard(F&& f) {
  try {
    return RecordStatus(f());
  } catch (const std::exception& e) {
    return RecordStatus(Status(HVDLITE_ERR_INTERNAL, std::string("internal error: ") + e.what()));
  }
}

// A copy of a buffer placed so that its last byte is the last readable one: the next
// page is PROT_NONE, so reading past the end faults at once.
class GuardedCopy {
 public:
  GuardedCopy(const uint8_t* data, size_t len) {
    size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    size_t body = (len + page - 1) / page * page;
    if (body == 0) body = page;
    size_ = body + page;
    void* m = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    base_ = static_cast<uint8_t*>(m);
    mprotect(base_ + body, page, PROT_NONE);
    data_ = base_ + body - len;
    if (len) std::memcpy(data_, data, len);
  }
  ~GuardedCopy() { munmap(base_, size_); }
  const uint8_t* data() const { return data_; }

 private:
  uint8_t* base_ = nullptr;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

Status CopyOut(const std::vector<uint8_t>& blob, uint8_t* out, int64_t cap, int64_t* out_len) {
  if (!out_len) return InvalidArgument("out_len is NULL");
  *out_len = static_cast<int64_t>(blob.size());
  if (static_cast<int64_t>(blob.size()) > cap || (!out && !blob.empty())) {
    return InvalidArgument("output buffer too small: " + std::to_string(blob.size()) +
                           " bytes needed");
  }
  if (!blob.empty()) std::memcpy(out, blob.data(), blob.size());
  return Status::OK();
}

template <typename T>
Status RoundTrip(const uint8_t* in, int64_t len, uint8_t* out, int64_t cap, int64_t* out_len,
                 int32_t* count,
                 Status (*parse)(const uint8_t*, size_t, std::vector<T>*),
                 void (*serialize)(const std::vector<T>&, std::vector<uint8_t>*)) {
  if (len < 0 || (len > 0 && !in)) return InvalidArgument("bad input buffer");
  GuardedCopy copy(in, static_cast<size_t>(len));
  std::vector<T> items;
  Status s = parse(copy.data(), static_cast<size_t>(len), &items);
  if (!s.ok()) return s;
  if (count) *count = static_cast<int32_t>(items.size());
  std::vector<uint8_t> blob;
  serialize(items, &blob);
  return CopyOut(blob, out, cap, out_len);
}

struct SimController {
  Controller controller;
  Controller::Clock::time_point epoch;
  std::vector<uint8_t> unread;  // a decision whose output did not fit yet
  bool has_unread = false;
  SimController(int size, const Config& c) : controller(size, c), epoch(Controller::Clock::now()) {}
  Controller::Clock::time_point At(double s) const {
    return epoch + std::chrono::duration_cast<Controller::Clock::duration>(
                       std::chrono::duration<double>(s));
  }
};

std::mutex g_sims_mutex;
std::map<int64_t, std::unique_ptr<SimController>> g_sims;  // Guarded by g_sims_mutex.
int64_t g_next_sim = 1;                                    // Guarded by g_sims_mutex.

Status FindSim(int64_t id, SimController** out) {
  std::lock_guard<std::mutex> lock(g_sims_mutex);
  auto it = g_sims.find(id);
  if (it == g_sims.end()) return InvalidArgument("unknown test controller " + std::to_string(id));
  *out = it->second.get();
  return Status::OK();
}

}  // namespace
}  // namespace hvdlite

using hvdlite::Status;

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_roundtrip_requests(const uint8_t* in, int64_t len,
                                                                uint8_t* out, int64_t out_cap,
                                                                int64_t* out_len, int32_t* count) {
  return hvdlite::Guard([&] {
    return hvdlite::RoundTrip<hvdlite::Request>(in, len, out, out_cap, out_len, count,
                                                hvdlite::ParseRequests, hvdlite::SerializeRequests);
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_roundtrip_responses(const uint8_t* in, int64_t len,
                                                                 uint8_t* out, int64_t out_cap,
                                                                 int64_t* out_len, int32_t* count) {
  return hvdlite::Guard([&] {
    return hvdlite::RoundTrip<hvdlite::Response>(in, len, out, out_cap, out_len, count,
                                                 hvdlite::ParseResponses,
                                                 hvdlite::SerializeResponses);
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_controller_new(int32_t size, double stall_check_s,
                                                            double stall_shutdown_s, int64_t* out) {
  return hvdlite::Guard([&] {
    if (!out) return hvdlite::InvalidArgument("out is NULL");
    if (size < 1 || size > 4096) return hvdlite::InvalidArgument("size out of range");
    hvdlite::Config config;
    config.stall_check_s = stall_check_s;
    config.stall_shutdown_s = stall_shutdown_s;
    std::lock_guard<std::mutex> lock(hvdlite::g_sims_mutex);
    int64_t id = hvdlite::g_next_sim++;
    hvdlite::g_sims[id].reset(new hvdlite::SimController(size, config));
    *out = id;
    return Status::OK();
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_controller_add(int64_t id, const uint8_t* requests,
                                                            int64_t len, double now_s) {
  return hvdlite::Guard([&] {
    hvdlite::SimController* sim = nullptr;
    Status s = hvdlite::FindSim(id, &sim);
    if (!s.ok()) return s;
    if (len < 0 || (len > 0 && !requests)) return hvdlite::InvalidArgument("bad input buffer");
    hvdlite::GuardedCopy copy(requests, static_cast<size_t>(len));
    std::vector<hvdlite::Request> reqs;
    s = hvdlite::ParseRequests(copy.data(), static_cast<size_t>(len), &reqs);
    if (!s.ok()) return s;
    for (const auto& q : reqs) sim->controller.AddRequest(q, sim->At(now_s));
    return Status::OK();
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_controller_build(int64_t id, double now_s, uint8_t* out,
                                                              int64_t out_cap, int64_t* out_len) {
  return hvdlite::Guard([&] {
    hvdlite::SimController* sim = nullptr;
    Status s = hvdlite::FindSim(id, &sim);
    if (!s.ok()) return s;
    if (!sim->has_unread) {
      hvdlite::SerializeResponses(sim->controller.BuildResponses(sim->At(now_s)), &sim->unread);
      sim->has_unread = true;
    }
    s = hvdlite::CopyOut(sim->unread, out, out_cap, out_len);
    if (s.ok()) sim->has_unread = false;
    return s;
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_controller_pending(int64_t id, int64_t* out) {
  return hvdlite::Guard([&] {
    hvdlite::SimController* sim = nullptr;
    Status s = hvdlite::FindSim(id, &sim);
    if (!s.ok()) return s;
    if (!out) return hvdlite::InvalidArgument("out is NULL");
    *out = static_cast<int64_t>(sim->controller.NumPending());
    return Status::OK();
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_controller_free(int64_t id) {
  return hvdlite::Guard([&] {
    std::lock_guard<std::mutex> lock(hvdlite::g_sims_mutex);
    hvdlite::g_sims.erase(id);
    return Status::OK();
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_allreduce_step(int32_t n, void** ins, void** outs,
                                                            int64_t elements, const char* prefix) {
  if (n < 0 || (n > 0 && (!ins || !outs || !prefix))) {
    return hvdlite::RecordStatus(hvdlite::InvalidArgument("bad arguments"));
  }
  // The public entry points, as a C caller would use them: each records its own status.
  std::vector<hvdlite_handle_t> handles;
  handles.reserve(n);
  hvdlite_status_t first = HVDLITE_OK;
  for (int32_t i = 0; i < n && first == HVDLITE_OK; ++i) {
    const std::string name = std::string(prefix) + "." + std::to_string(i);
    hvdlite_tensor_t t{name.c_str(), HVDLITE_OP_ALLREDUCE, HVDLITE_FLOAT32, 1, &elements,
                       nullptr, nullptr, HVDLITE_SUM, 1.0, 1.0, 0, nullptr, 0, -1, nullptr};
    hvdlite_handle_t h = 0;
    first = hvdlite_enqueue_buffers(&t, ins[i], outs[i], &h);
    if (first == HVDLITE_OK) handles.push_back(h);
  }
  std::string message = first == HVDLITE_OK ? "" : hvdlite_last_error();
  for (hvdlite_handle_t h : handles) {
    hvdlite_status_t s = hvdlite_wait_release(h, -1.0);
    if (first == HVDLITE_OK && s != HVDLITE_OK) {
      first = s;
      message = hvdlite_last_error();
    }
  }
  // The calls after the first failure recorded their own statuses: record it again.
  return first == HVDLITE_OK ? first : hvdlite::RecordStatus(Status(first, message));
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_queue_remove_pending(int64_t* pending_after) {
  using namespace hvdlite;
  return Guard([&] {
    if (!pending_after) return InvalidArgument("pending_after is NULL");
    TensorQueue queue;
    std::vector<TensorEntry*> taken;
    queue.PopPending(&taken);  // a cycle starts with nothing pending
    std::vector<TensorEntry> added(1);
    added[0].request.name = "x";
    added[0].request.shape = {1, 2, 3};
    added[0].handle = 7;
    Status s = queue.Add(std::move(added));  // submitted during that cycle
    if (!s.ok()) return s;
    TensorEntry* entry = queue.Find("x");  // a response names it: executed, removed
    if (!entry) return Status(HVDLITE_ERR_INTERNAL, "the added entry is not found");
    queue.RemoveAll({entry});
    queue.PopPending(&taken);  // the next cycle
    *pending_after = static_cast<int64_t>(taken.size());
    return Status::OK();
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_fault_in_mpi(void) {
  hvdlite::RequestFaultInMpiForTest(false);
  return HVDLITE_OK;
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_fault_in_caller_cycle(double delay_s) {
  hvdlite::RequestFaultInMpiForTest(true, delay_s);
  return HVDLITE_OK;
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_knob_search(int32_t hierarchy, int32_t fixed, int64_t max_trials,
                                                         const double* scores, int64_t n_scores,
                                                         hvdlite_autotune_t* candidates, int64_t cap,
                                                         int64_t* count, int32_t* done, hvdlite_autotune_t* best) {
  return hvdlite::Guard([&] {
    using hvdlite::TunedKnobs;
    if (!count || !done || !best || (n_scores > 0 && !scores) || (cap > 0 && !candidates)) {
      return hvdlite::InvalidArgument("knob search: NULL argument");
    }
    hvdlite::Config config;
    hvdlite::AutotuneSettings settings;
    settings.enabled = true;
    settings.max_samples = max_trials;
    settings.fixed_fusion_threshold = fixed & 1;
    settings.fixed_cycle_time = fixed & 2;
    settings.fixed_hierarchical = fixed & 4;
    TunedKnobs start;
    start.fusion_threshold = config.fusion_threshold;
    start.cycle_time_ms = config.cycle_time_ms;
    start.shm_chunk_bytes = hvdlite::ShmCollectives::kChunkBytes;
    hvdlite::KnobSearch search(start, settings, !(fixed & 8), hierarchy != 0, hvdlite::ShmCollectives::kChunkBytes);
    auto put = [](const TunedKnobs& k, hvdlite_autotune_t* out) {
      *out = hvdlite_autotune_t();
      out->enabled = 1;
      out->fusion_threshold = k.fusion_threshold;
      out->cycle_time_ms = k.cycle_time_ms;
      out->shm_chunk_bytes = k.shm_chunk_bytes;
      out->hierarchical = k.hierarchical;
    };
    *count = 0;
    for (int64_t i = 0; i <= n_scores && !search.done(); ++i) {
      if (*count >= cap) return hvdlite::InvalidArgument("knob search: candidates too small");
      put(search.candidate(), &candidates[(*count)++]);
      if (i < n_scores) search.Record(scores[i]);
    }
    *done = search.done();
    put(search.best(), best);
    best->settled = *done;
    best->trials = search.trials();
    return hvdlite::Status::OK();
  });
}

HVDLITE_EXPORT hvdlite_status_t hvdlite_test_timeline_steps(const char* path, int32_t tensors,
                                                           int32_t steps, int64_t ring_words,
                                                           int32_t hold_writer,
                                                           int32_t drain_every, int64_t* asked,
                                                           int64_t* dropped) {
  using namespace hvdlite;
  return Guard([&] {
    if (!path || !asked || !dropped) return InvalidArgument("path, asked or dropped is NULL");
    if (tensors <= 0 || steps < 0 || ring_words <= 0) {
      return InvalidArgument("tensors and ring_words must be positive, steps not negative");
    }
    if (hold_writer && drain_every > 0) {
      return InvalidArgument("a held writer never drains: hold_writer with drain_every > 0");
    }
    Timeline timeline(static_cast<size_t>(ring_words));
    Status s = timeline.Start(path, false);
    if (!s.ok()) return s;
    timeline.HoldWriter(hold_writer != 0);
    std::vector<std::string> names;
    for (int32_t i = 0; i < tensors; ++i) names.push_back("t." + std::to_string(i));
    std::vector<const std::string*> all;
    for (const std::string& n : names) all.push_back(&n);
    const std::string args = "\"dtype\": \"float32\", \"shape\": \"[4]\", \"bytes\": 16, "
                             "\"fused\": " + std::to_string(tensors);
    for (int32_t step = 0; step < steps; ++step) {
      // SortFresh, Coordinate, Execute, ExecuteAllreduce: the loop's calls in its order.
      timeline.BeginNegotiationAll(all, "NEGOTIATE_ALLREDUCE");
      timeline.InstantAll(all, "rank 0 ready", "\"cached\": true");
      timeline.InstantAll(all, "all ranks ready", "\"cached\": true");
      timeline.EndAll(all);
      timeline.BeginOps(all, "ALLREDUCE", [](size_t) { return uint64_t{1}; },
                        [&](size_t) { return args; });
      const int64_t queued = Timeline::Now();
      std::vector<int> tids = timeline.OpenTracks(all);
      const int64_t started = Timeline::Now();
      timeline.Complete(tids, "QUEUE", queued, started);
      timeline.Complete(tids, "SHM_ALLREDUCE", started, Timeline::Now());
      timeline.EndAll(all);
      if (drain_every > 0 && (step + 1) % drain_every == 0) timeline.WaitWritten();
    }
    *asked = int64_t{6} * tensors * steps;
    *dropped = timeline.dropped();
    timeline.Stop();
    return Status::OK();
  });
}
