// Knobs read from HVDLITE_* environment variables at init.
#pragma once

#include <cstdint>
#include <string>

#include "common/common.h"

namespace hvdlite {

// HVDLITE_AUTOTUNE* (autotune.h; Python maps Horovod's HOROVOD_AUTOTUNE* onto them).
struct AutotuneSettings {
  bool enabled = false;           // HVDLITE_AUTOTUNE
  std::string log_path;           // HVDLITE_AUTOTUNE_LOG: CSV of the trials (rank 0)
  int64_t warmup_samples = 3;     // HVDLITE_AUTOTUNE_WARMUP_SAMPLES, thrown away
  int64_t steps_per_sample = 10;  // HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE: cycles that moved data
  int64_t max_samples = 20;       // HVDLITE_AUTOTUNE_MAX_SAMPLES: trials at most
  // HVDLITE_AUTOTUNE_SAMPLE_SECONDS: a sample also lasts at least this long. A cycle is
  // a fraction of a training step, so a few cycles alone would score a step's edges.
  double sample_seconds = 0.25;
  // Knobs whose variable the user set are kept as set, as Horovod's autotune does.
  bool fixed_fusion_threshold = false, fixed_cycle_time = false, fixed_hierarchical = false;
};

struct Config {
  int64_t fusion_threshold = 128LL * 1024 * 1024;  // HVDLITE_FUSION_THRESHOLD, bytes; 0: off
  double cycle_time_ms = 1.0;                      // HVDLITE_CYCLE_TIME
  int64_t cache_capacity = 1024;                   // HVDLITE_CACHE_CAPACITY; 0: off
  double stall_check_s = 60.0;                     // HVDLITE_STALL_CHECK_TIME; 0: off
  double stall_shutdown_s = 0.0;                   // HVDLITE_STALL_SHUTDOWN_TIME; 0: off
  std::string timeline_path;                       // HVDLITE_TIMELINE
  bool timeline_mark_cycles = false;               // HVDLITE_TIMELINE_MARK_CYCLES
  // HVDLITE_MPI_THREAD_FUNNELED=1: when the core initializes MPI, ask only for
  // MPI_THREAD_FUNNELED (the background thread makes every MPI call). MPICH's
  // small-message latency is several times lower then, but its blocking calls spin
  // without yielding: with more busy threads than cores (oversubscribed ranks), a 3-rank
  // job on 2 cores ran 7x slower. Default MPI_THREAD_MULTIPLE, which also lets other
  // threads (mpi4py) use MPI after init.
  bool mpi_thread_multiple = true;
  // HVDLITE_SHM_ALLREDUCE=0: allreduce with MPI_Allreduce even when every rank is on
  // one machine (by default those go through shared memory: ShmCollectives).
  bool shm_allreduce = true;
  // HVDLITE_CALLER_CYCLE=0: a thread that blocks on a collective always hands it to the
  // background thread (by default, on one host, it runs the collective's cycle itself
  // when nothing else of this rank is in flight: Core::RunCallerCycle).
  bool caller_cycle = true;
  // HVDLITE_CARRY_DATA=0: a small cached op alone in its round never rides with the
  // coordination (by default, on one host or across hosts of one rank each, its data
  // does: ProcessSetState::Carry).
  bool carry_data = true;
  // HVDLITE_HIERARCHICAL_ALLREDUCE=0/1 (or Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE;
  // ours wins when both are set): -1 when unset, the hierarchical allreduce then on
  // with more than one host and more than one rank on each (topology_layers.h).
  int hierarchical_allreduce = -1;
  // HVDLITE_HIERARCHICAL_ALLGATHER=0/1 (Horovod's name: hvdlite/env_aliases.py) and
  // HVDLITE_HIERARCHICAL_BROADCAST=0/1: the same for allgather and broadcast, which go
  // through the hosts' leaders (hierarchical_allgather.h, hierarchical_broadcast.h).
  int hierarchical_allgather = -1;
  int hierarchical_broadcast = -1;
  // HVDLITE_BIND_TO=core: every thread of local rank r of n on a host is bound to the
  // r-th of n equal blocks of the cores the process may use (thread_sched.h); "none"
  // (the default) binds nothing.
  bool bind_to_core = false;
  // HVDLITE_BACKGROUND_REALTIME=0/1: the background thread real-time (thread_sched.h).
  // Unset (-1): real-time where the kernel permits it, silently normal where not; 1:
  // the same, but a refusal is a warning that says why; 0: normal priority.
  int background_realtime = -1;
  // HVDLITE_GPU_OPERATIONS=NCCL|MPI (Horovod's HOROVOD_GPU_OPERATIONS is an alias): how
  // collectives on GPU tensors run. Unset: NCCL where each rank of a host has a GPU of
  // its own and NCCL opens, else staged through pinned host memory into the CPU paths.
  // NCCL: NCCL or an error saying why not; MPI: always staged.
  enum class GpuOperations { kAuto, kNccl, kStaged };
  GpuOperations gpu_operations = GpuOperations::kAuto;
  // HVDLITE_GPU_STAGE_CHUNK, bytes: a staged allreduce moves and reduces its tensors in
  // pieces of this size, so that the copies between the GPU and host memory overlap the
  // reduction of the piece before (gpu_execution.cc); 0: one piece.
  int64_t gpu_stage_chunk = 4LL * 1024 * 1024;
  // HVDLITE_HOST_ID: ranks with equal ids count as one host (testing, advanced).
  std::string host_id;
  AutotuneSettings autotune;
};

// Reads the environment; a malformed value is an error naming the variable.
Status LoadConfig(Config* config);

}  // namespace hvdlite
