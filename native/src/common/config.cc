#include "common/config.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>

namespace hvdlite {
namespace {

Status ReadDouble(const char* var, double min, double* out) {
  const char* env = std::getenv(var);
  if (!env || !*env) return Status::OK();
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(env, &end);
  if (errno || *end || v < min) {
    return InvalidArgument(std::string(var) + "='" + env + "' is not a number >= " +
                           std::to_string(min));
  }
  *out = v;
  return Status::OK();
}

Status ReadInt(const char* var, int64_t min, int64_t* out) {
  const char* env = std::getenv(var);
  if (!env || !*env) return Status::OK();
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(env, &end, 10);
  if (errno || *end || v < min) {
    return InvalidArgument(std::string(var) + "='" + env + "' is not an integer >= " +
                           std::to_string(min));
  }
  *out = v;
  return Status::OK();
}

// A 0/1 switch that may also be set under Horovod's name; ours wins. Unset: -1.
Status ReadSwitch(const char* var, const char* horovod_var, int* out) {
  const char* used = std::getenv(var) && *std::getenv(var) ? var : horovod_var;
  const char* env = std::getenv(used);
  if (!env || !*env) return Status::OK();
  const std::string v = env;
  if (v == "1" || v == "true") {
    *out = 1;
  } else if (v == "0" || v == "false") {
    *out = 0;
  } else {
    return InvalidArgument(std::string(used) + "='" + v + "' must be 0 or 1");
  }
  return Status::OK();
}

bool IsSet(const char* var) { return std::getenv(var) && *std::getenv(var); }

Status LoadAutotune(AutotuneSettings* a) {
  Status s;
  if (const char* m = std::getenv("HVDLITE_AUTOTUNE")) a->enabled = std::string(m) == "1" || std::string(m) == "true";
  if (const char* l = std::getenv("HVDLITE_AUTOTUNE_LOG")) a->log_path = l;
  if (!(s = ReadInt("HVDLITE_AUTOTUNE_WARMUP_SAMPLES", 0, &a->warmup_samples)).ok()) return s;
  if (!(s = ReadInt("HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE", 1, &a->steps_per_sample)).ok()) return s;
  if (!(s = ReadInt("HVDLITE_AUTOTUNE_MAX_SAMPLES", 1, &a->max_samples)).ok()) return s;
  if (!(s = ReadDouble("HVDLITE_AUTOTUNE_SAMPLE_SECONDS", 0.0, &a->sample_seconds)).ok()) return s;
  a->fixed_fusion_threshold = IsSet("HVDLITE_FUSION_THRESHOLD");
  a->fixed_cycle_time = IsSet("HVDLITE_CYCLE_TIME");
  a->fixed_hierarchical = IsSet("HVDLITE_HIERARCHICAL_ALLREDUCE") || IsSet("HOROVOD_HIERARCHICAL_ALLREDUCE");
  return Status::OK();
}

}  // namespace

Status LoadConfig(Config* c) {
  Status s;
  if (!(s = ReadInt("HVDLITE_FUSION_THRESHOLD", 0, &c->fusion_threshold)).ok()) return s;
  if (!(s = ReadDouble("HVDLITE_CYCLE_TIME", 0.0, &c->cycle_time_ms)).ok()) return s;
  if (!(s = ReadInt("HVDLITE_CACHE_CAPACITY", 0, &c->cache_capacity)).ok()) return s;
  if (!(s = ReadDouble("HVDLITE_STALL_CHECK_TIME", 0.0, &c->stall_check_s)).ok()) return s;
  if (!(s = ReadDouble("HVDLITE_STALL_SHUTDOWN_TIME", 0.0, &c->stall_shutdown_s)).ok()) return s;
  if (c->cache_capacity > (1 << 20)) {
    return InvalidArgument("HVDLITE_CACHE_CAPACITY must be at most 1048576");
  }
  if (const char* t = std::getenv("HVDLITE_TIMELINE")) c->timeline_path = t;
  if (const char* m = std::getenv("HVDLITE_TIMELINE_MARK_CYCLES")) {
    c->timeline_mark_cycles = std::string(m) == "1" || std::string(m) == "true";
  }
  if (const char* m = std::getenv("HVDLITE_SHM_ALLREDUCE")) {
    c->shm_allreduce = !(std::string(m) == "0" || std::string(m) == "false");
  }
  if (const char* m = std::getenv("HVDLITE_CALLER_CYCLE")) {
    c->caller_cycle = !(std::string(m) == "0" || std::string(m) == "false");
  }
  if (const char* m = std::getenv("HVDLITE_CARRY_DATA")) {
    c->carry_data = !(std::string(m) == "0" || std::string(m) == "false");
  }
  if (!(s = ReadSwitch("HVDLITE_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE",
                       &c->hierarchical_allreduce)).ok() ||
      !(s = ReadSwitch("HVDLITE_HIERARCHICAL_ALLGATHER", "HVDLITE_HIERARCHICAL_ALLGATHER",
                       &c->hierarchical_allgather)).ok() ||
      !(s = ReadSwitch("HVDLITE_HIERARCHICAL_BROADCAST", "HVDLITE_HIERARCHICAL_BROADCAST",
                       &c->hierarchical_broadcast)).ok() ||
      !(s = ReadSwitch("HVDLITE_BACKGROUND_REALTIME", "HVDLITE_BACKGROUND_REALTIME",
                       &c->background_realtime)).ok()) {
    return s;
  }
  if (const char* b = std::getenv("HVDLITE_BIND_TO"); b && *b) {
    const std::string v = b;
    if (v != "core" && v != "none") {
      return InvalidArgument("HVDLITE_BIND_TO='" + v + "' must be core or none");
    }
    c->bind_to_core = v == "core";
  }
  if (const char* g = std::getenv("HVDLITE_GPU_OPERATIONS"); g && *g) {
    std::string v = g;
    for (char& ch : v) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    if (v == "NCCL") {
      c->gpu_operations = Config::GpuOperations::kNccl;
    } else if (v == "MPI") {
      c->gpu_operations = Config::GpuOperations::kStaged;
    } else {
      return InvalidArgument("HVDLITE_GPU_OPERATIONS='" + std::string(g) +
                             "' must be NCCL or MPI (this build has no GLOO, DDL or CCL path)");
    }
  }
  if (!(s = ReadInt("HVDLITE_GPU_STAGE_CHUNK", 0, &c->gpu_stage_chunk)).ok()) return s;
  if (const char* h = std::getenv("HVDLITE_HOST_ID")) c->host_id = h;
  if (const char* m = std::getenv("HVDLITE_MPI_THREAD_FUNNELED")) {
    c->mpi_thread_multiple = !(std::string(m) == "1" || std::string(m) == "true");
  }
  return LoadAutotune(&c->autotune);
}

}  // namespace hvdlite
