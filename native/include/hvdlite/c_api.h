/*
 * hvdlite C API: the only surface the Python adapters see.
 *
 * Every function returns an hvdlite_status_t; results come back through out-pointers.
 * When a call fails, hvdlite_last_error() returns a message for the calling thread
 * (thread-local), valid until that thread's next hvdlite call.
 *
 * Threads: any framework thread may call these functions. Only the core's background
 * thread talks to MPI/NCCL; enqueue returns at once and hvdlite_wait blocks on a
 * condition variable (cffi releases the GIL around the call).
 *
 * The block between the CDEF markers is plain C that hvdlite/_native.py hands to
 * cffi's cdef(): declarations are never copied by hand.
 */
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* CDEF-BEGIN */

typedef int32_t hvdlite_status_t;
enum {
  HVDLITE_OK = 0,
  HVDLITE_ERR_NOT_INITIALIZED = 1,   /* called before hvdlite_init or after shutdown */
  HVDLITE_ERR_INVALID_ARGUMENT = 2,  /* refused at the call; nothing was enqueued */
  HVDLITE_ERR_DUPLICATE_NAME = 3,    /* a tensor of that name is already in flight */
  HVDLITE_ERR_MISMATCH = 4,          /* ranks disagree on a tensor's properties */
  HVDLITE_ERR_SHUTDOWN = 5,          /* the core shut down before the op finished */
  HVDLITE_ERR_STALLED = 6,           /* some ranks never submitted the tensor in time */
  HVDLITE_ERR_MPI = 7,               /* the transport reported an error */
  HVDLITE_ERR_INVALID_HANDLE = 8,    /* unknown or released handle */
  HVDLITE_ERR_IN_PROGRESS = 9,       /* the op has not finished yet */
  HVDLITE_ERR_ALREADY_INITIALIZED = 10,
  HVDLITE_ERR_TIMEOUT = 11,          /* hvdlite_wait timed out; the op goes on */
  HVDLITE_ERR_RANK_FAILED = 12,      /* a peer rank is gone */
  HVDLITE_ERR_INTERNAL = 13,
  HVDLITE_ERR_ABORTED = 14           /* the op cannot run: another rank refused it, or it
                                        is not supported while ranks have joined */
};

/* Element types. Values are part of the wire format: append only. */
typedef int32_t hvdlite_dtype_t;
enum {
  HVDLITE_UINT8 = 0,
  HVDLITE_INT8 = 1,
  HVDLITE_INT32 = 2,
  HVDLITE_INT64 = 3,
  HVDLITE_FLOAT16 = 4,
  HVDLITE_BFLOAT16 = 5,
  HVDLITE_FLOAT32 = 6,
  HVDLITE_FLOAT64 = 7,
  HVDLITE_BOOL = 8,
  HVDLITE_INT16 = 9,
  HVDLITE_UINT16 = 10
};

/* Collectives. Values are part of the wire format: append only. */
typedef int32_t hvdlite_op_t;
enum {
  HVDLITE_OP_ALLREDUCE = 0,
  HVDLITE_OP_ALLGATHER = 1,
  HVDLITE_OP_BROADCAST = 2,
  HVDLITE_OP_ALLTOALL = 3,
  HVDLITE_OP_REDUCESCATTER = 4,
  HVDLITE_OP_BARRIER = 5,
  HVDLITE_OP_JOIN = 6,
  /* Changes of the process-set table, negotiated like collectives over the global set.
   * Made by hvdlite_add_process_set and hvdlite_remove_process_set only: hvdlite_enqueue
   * refuses them. */
  HVDLITE_OP_ADD_PROCESS_SET = 7,
  HVDLITE_OP_REMOVE_PROCESS_SET = 8
};

/* Reductions. Average is Sum followed by a division by the number of contributing
 * ranks (integer types truncate toward zero, as Horovod's do);
 * joined ranks count, as in Horovod. */
typedef int32_t hvdlite_reduce_op_t;
enum {
  HVDLITE_AVERAGE = 0,
  HVDLITE_SUM = 1,
  HVDLITE_MIN = 2,
  HVDLITE_MAX = 3,
  HVDLITE_PRODUCT = 4,
  /* Adasum runs in the Python layer (hvdlite/adasum.py, over allgather); the core
   * refuses it. The value is here so that Python never writes a code by hand. */
  HVDLITE_ADASUM = 5
};

/* The most data a small op carries, per rank, with the coordination round that agrees to
 * run it (a repeated op of at most this many bytes on every rank then takes one exchange,
 * not two). The object collectives size the array that carries an object by it. */
enum { HVDLITE_CARRIED_MAX_BYTES = 16384 };

/* An opaque handle to one enqueued op. 0 is never a valid handle. */
typedef int64_t hvdlite_handle_t;

typedef struct {
  /* Fortran handle (MPI_Comm_c2f) of a communicator to run on, e.g. mpi4py's
   * comm.py2f(); -1 means MPI_COMM_WORLD. The core duplicates it. */
  int64_t comm_f2c;
} hvdlite_init_options_t;

/* One tensor handed to the core.
 *
 * Buffer ownership:
 *  - input, and output where the caller passes one, belong to the caller. The core
 *    reads input and writes output from its background thread until the handle has
 *    ended (hvdlite_poll says done, or hvdlite_wait returned), so the caller keeps them
 *    alive and leaves input unchanged until then. The core never frees them.
 *  - ALLGATHER and ALLTOALL results belong to the handle: see hvdlite_handle_output.
 *  - name, shape and splits are copied during hvdlite_enqueue; the caller may free
 *    them as soon as it returns. */
typedef struct {
  const char* name;            /* UTF-8, NUL-terminated; equal across ranks */
  hvdlite_op_t op;
  hvdlite_dtype_t dtype;
  int32_t ndim;                /* 0 for a scalar */
  const int64_t* shape;        /* ndim entries */
  const void* input;           /* C-contiguous */
  /* Caller-owned result for ALLREDUCE, BROADCAST and REDUCESCATTER (may equal input
   * for in-place ops; REDUCESCATTER's holds this rank's rows). ALLGATHER and ALLTOALL
   * leave it NULL: their result size is known only after negotiation, so the core
   * allocates it (see hvdlite_handle_output). */
  void* output;
  hvdlite_reduce_op_t reduce_op; /* ALLREDUCE, REDUCESCATTER */
  double prescale_factor;      /* applied to the input before the reduction */
  double postscale_factor;     /* applied to the result */
  int32_t root_rank;           /* BROADCAST */
  const int64_t* splits;       /* ALLTOALL: size() row counts, or NULL for even splits */
  /* The process set that runs the op: 0 is every rank (the global set), others come
   * from hvdlite_add_process_set. Only its members may submit to it; root_rank is a
   * global rank that must be a member, splits have one entry per member (in rank
   * order), REDUCESCATTER splits rows and ALLGATHER concatenates among the members. */
  int32_t process_set_id;
  int32_t device;              /* -1: host memory; else the CUDA device ordinal */
  /* A device tensor's cudaEvent_t, recorded on the framework's stream after the input was
   * produced and the output allocated: the core's stream waits on it before it reads or
   * writes either (no device-wide synchronize). NULL: nothing to wait for. The caller
   * keeps the event alive until the handle has ended. Ignored for host memory. */
  const void* ready_event;
} hvdlite_tensor_t;

/* Counters since init, for tests and tuning. */
typedef struct {
  int64_t cycles;              /* background loop cycles */
  int64_t coordinator_gathers; /* cycles that sent requests to the coordinator */
  int64_t cache_hits;          /* requests negotiated by cache bit alone */
  int64_t cache_misses;        /* requests that went to the coordinator */
  int64_t collectives;         /* transport collectives executed */
  int64_t fused_collectives;   /* of which carried more than one tensor */
  int64_t tensors;             /* tensors completed */
  int64_t bytes;               /* payload bytes through collectives */
  int64_t errors;              /* ops that ended in an error */
  int64_t shm_collectives;     /* of the collectives, those through shared memory (allreduce; reducescatter, allgather, broadcast, alltoall) */
  int64_t wire_bytes;          /* bytes this rank sent to other ranks, counted as a
                                * bandwidth-optimal algorithm sends them (allreduce of S
                                * bytes on n ranks: 2(n-1)/n S; allgather, broadcast,
                                * reducescatter of a result of S bytes: (n-1)/n S;
                                * alltoall: the rows sent to other ranks) */
  int64_t hierarchical_collectives; /* of the collectives, hierarchical allreduces (hosts, then
                                    * across hosts, then hosts again) */
  int64_t nccl_collectives;    /* of the collectives, on GPU tensors through NCCL */
  int64_t staged_collectives;  /* of the collectives, on GPU tensors staged through host memory */
  int64_t nccl_us;             /* microseconds the background thread spent on the NCCL
                                * collectives: waiting for the inputs' events, packing,
                                * the collective, unpacking, until the core's stream ended */
  int64_t waiting_threads;     /* not a count since init: the threads waiting for a result
                                * right now (a blocking op's caller from its enqueue on) */
  int64_t caller_cycles;       /* cycles run by a thread blocked on its op rather than by
                                * the background thread (HVDLITE_CALLER_CYCLE) */
  int64_t carried_collectives; /* of the collectives, those whose data rode with the
                                * coordination round (one host, or up to 8 hosts:
                                * HVDLITE_CARRY_DATA) */
} hvdlite_stats_t;

/* Starts the core: MPI (unless already initialized, e.g. by mpi4py), the background
 * thread, configuration from HVDLITE_* variables. options may be NULL. */
hvdlite_status_t hvdlite_init(const hvdlite_init_options_t* options);

/* Stops the background thread on every rank and fails pending handles with
 * HVDLITE_ERR_SHUTDOWN. Idempotent. MPI is finalized at process exit only if the
 * core initialized it. */
hvdlite_status_t hvdlite_shutdown(void);

/* The launcher reported lost peers (hvdlite's notice reader calls this; any thread, at
 * any time, before or after init). A framework thread that runs its own blocking call's
 * cycle across hosts leaves it at its next MPI call instead of waiting for an answer
 * that will not come; no cycle runs after that, and the ops fail with the notice (the
 * launcher's words, which ranks and hosts were lost; NULL: none; the first one stays). */
hvdlite_status_t hvdlite_note_lost_peers(const char* notice);

hvdlite_status_t hvdlite_is_initialized(int32_t* out);
hvdlite_status_t hvdlite_rank(int32_t* out);
hvdlite_status_t hvdlite_size(int32_t* out);
hvdlite_status_t hvdlite_local_rank(int32_t* out);
hvdlite_status_t hvdlite_local_size(int32_t* out);
hvdlite_status_t hvdlite_cross_rank(int32_t* out);
hvdlite_status_t hvdlite_cross_size(int32_t* out);
hvdlite_status_t hvdlite_mpi_threads_supported(int32_t* out);

/* Validates and enqueues one tensor; returns a handle at once. */
hvdlite_status_t hvdlite_enqueue(const hvdlite_tensor_t* tensor, hvdlite_handle_t* out);

/* hvdlite_enqueue of *tensor with its input and output replaced by these two: the same
 * checks and effect. The per-step path: a caller that submits the same tensors every
 * step fills each struct once and passes only that step's buffers (four arguments to
 * convert per call instead of fourteen). The struct is only read, so threads may share
 * it. */
hvdlite_status_t hvdlite_enqueue_buffers(const hvdlite_tensor_t* tensor, const void* input,
                                         void* output, hvdlite_handle_t* out);

/* hvdlite_enqueue_buffers, then hvdlite_wait (release != 0: hvdlite_wait_release) of
 * the new handle, for a caller that waits for the op at once (a blocking collective):
 * returns the enqueue's status; when that is HVDLITE_OK, *op_status is the wait's (the
 * op's own status, or HVDLITE_ERR_TIMEOUT with the op still running and *out still to be
 * waited). Without release, *out stays valid for hvdlite_handle_output and the like. The
 * core knows from the start that the caller waits, so it runs the op's cycle at once
 * rather than first gathering a burst of requests. */
hvdlite_status_t hvdlite_enqueue_buffers_wait(const hvdlite_tensor_t* tensor, const void* input,
                                              void* output, double timeout_s, int32_t release,
                                              hvdlite_handle_t* out, hvdlite_status_t* op_status);

/* hvdlite_enqueue_buffers_wait for an ALLGATHER or ALLTOALL (whose result the core
 * allocates) of a caller that takes a small result at once: once the op ended well
 * within timeout_s, its result is taken in the same call as hvdlite_handle_take_output
 * takes it (into dst, capacity bytes; *nbytes, *first_dim, recv_splits), the handle
 * then released. Where *nbytes > capacity nothing was taken and *out stays for
 * hvdlite_handle_output; *nbytes is -1 where the op did not end well (*op_status says
 * how; *out as hvdlite_enqueue_buffers_wait leaves it without release). */
hvdlite_status_t hvdlite_enqueue_wait_take(const hvdlite_tensor_t* tensor, const void* input,
                                           double timeout_s, void* dst, int64_t capacity,
                                           int64_t* nbytes, int64_t* first_dim,
                                           int64_t* recv_splits, hvdlite_handle_t* out,
                                           hvdlite_status_t* op_status);

/* Enqueues n tensors that are negotiated and executed together, never split across
 * cycles. handles receives n entries. All or nothing: on error none is enqueued. */
hvdlite_status_t hvdlite_enqueue_group(const hvdlite_tensor_t* tensors, int32_t n,
                                       hvdlite_handle_t* handles);

/* Tells the other ranks that this rank refuses the op it would have enqueued as name
 * (e.g. its adapter rejected the tensor): every rank that submits, or has submitted,
 * that tensor for this collective gets HVDLITE_ERR_ABORTED naming this rank and
 * reason, instead of waiting for a stall. Nothing is enqueued on this rank: the name
 * stays free, and there is nothing to wait on. Returns at once; the coordinator hears
 * of it within a cycle. */
/* The caller of join() gave up waiting (an exception: Ctrl-C, a test's timeout): the
 * pending join fails with HVDLITE_ERR_ABORTED and the rank takes part in collectives as
 * before, on every rank, from the next round. Nothing happens if no join is pending (it
 * ended meanwhile). */
hvdlite_status_t hvdlite_leave_join(void);

hvdlite_status_t hvdlite_refuse(hvdlite_op_t op, const char* name, int32_t process_set_id,
                                const char* reason);

/* *done = 1 once the op has ended (successfully or not); also for a recently released
 * handle (see hvdlite_release). */
hvdlite_status_t hvdlite_poll(hvdlite_handle_t handle, int32_t* done);

/* Blocks until the op ends or timeout_s passes (timeout_s < 0: no limit). Returns the
 * op's own status; HVDLITE_ERR_TIMEOUT leaves the op running. */
hvdlite_status_t hvdlite_wait(hvdlite_handle_t handle, double timeout_s);

/* hvdlite_wait, then hvdlite_release once the op has ended (whatever its status but
 * HVDLITE_ERR_TIMEOUT): one call for an op whose result is in the caller's buffers.
 * Other threads waiting on the handle, or coming to it just after, still get its
 * status. */
hvdlite_status_t hvdlite_wait_release(hvdlite_handle_t handle, double timeout_s);

/* Result of an ended ALLGATHER or ALLTOALL: the core-allocated buffer, its size in
 * bytes, and its first dimension (the other dimensions are the input's).
 *
 * The core allocates this buffer in host memory once the op's size is known (after
 * negotiation), writes it from the background thread, and then never touches it again.
 * It belongs to the handle: the pointer stays valid, at the same address, from the
 * op's successful end until hvdlite_release(handle), which frees it; nothing else
 * does, not even hvdlite_shutdown. The holder may read and write it in place, so an
 * adapter can give it to its framework without a copy (numpy's __array_interface__,
 * torch.from_blob or DLPack) and call hvdlite_release from that tensor's deleter, on
 * any thread. It is aligned for every hvdlite dtype; when *nbytes is 0, *data may be
 * NULL and must not be dereferenced. Never free() it.
 *
 * For JOIN, *data is NULL, *nbytes 0 and *first_dim the last rank that joined; for
 * other ops all three are 0/NULL. Returns HVDLITE_ERR_IN_PROGRESS while the op is in
 * flight, and the op's own status if it failed. */
hvdlite_status_t hvdlite_handle_output(hvdlite_handle_t handle, void** data, int64_t* nbytes,
                                       int64_t* first_dim);

/* ALLTOALL: the rows received from each rank, copied into the caller's array of
 * size() entries. Same statuses as hvdlite_handle_output. */
hvdlite_status_t hvdlite_handle_recv_splits(hvdlite_handle_t handle, int64_t* splits);

/* An ended ALLGATHER's or ALLTOALL's result, copied into the caller's dst (capacity
 * bytes) when it fits, and then the handle released: one call where a caller that
 * waited for a small result would otherwise read its size, wrap the core's buffer and
 * release the handle later. *nbytes and *first_dim as hvdlite_handle_output; an
 * ALLTOALL's received row counts go to recv_splits (size() entries) when it is not
 * NULL. When the result does not fit (*nbytes > capacity), nothing is copied or
 * released: the buffer is there for hvdlite_handle_output. Same statuses as
 * hvdlite_handle_output. */
hvdlite_status_t hvdlite_handle_take_output(hvdlite_handle_t handle, void* dst, int64_t capacity,
                                            int64_t* nbytes, int64_t* first_dim,
                                            int64_t* recv_splits);

/* Forgets an ended handle and frees what the core allocated for it (the
 * hvdlite_handle_output buffer, which must no longer be in use). Any thread; also
 * after hvdlite_shutdown. Releasing an unknown handle is a no-op; releasing one in
 * flight is HVDLITE_ERR_IN_PROGRESS and changes nothing. A thread still waiting on an
 * ended handle gets its status; the handle goes when the last such waiter returns.
 * The op's status is kept for the last 4096 releases: hvdlite_wait (and
 * hvdlite_wait_release) on such a handle return it at once and hvdlite_poll says done,
 * so a thread that reaches a handle just after another released it, or a caller whose
 * wait was cut short after the release, still learns how the op ended. Anything else
 * on a released handle is HVDLITE_ERR_INVALID_HANDLE. */
hvdlite_status_t hvdlite_release(hvdlite_handle_t handle);

/* Releases handles[n-1], handles[n-2], ... for as long as each has ended successfully,
 * and says in *released how many it released; it stops at the first that is in flight,
 * failed or unknown, which is left as it was. For the ops of a group once its last op
 * was waited for: one call instead of a wait and a release for each. */
hvdlite_status_t hvdlite_release_ended(const hvdlite_handle_t* handles, int32_t n,
                                       int32_t* released);

hvdlite_status_t hvdlite_stats(hvdlite_stats_t* out);

/* Whether the core can open the CUDA runtime and NCCL (it opens them at run time, never
 * links them): their versions (CUDA: major*1000 + minor*10; NCCL: major*10000 +
 * minor*100 + patch), 0 where the library cannot be opened. Needs no init and no GPU. */
hvdlite_status_t hvdlite_gpu_support(int32_t* cuda_runtime_version, int32_t* nccl_version);

/* Autotune (HVDLITE_AUTOTUNE=1): the knob values in force on this rank, the same on
 * every rank from cycle to cycle, and how far the search is. */
typedef struct {
  int32_t enabled;            /* HVDLITE_AUTOTUNE was on at init */
  int32_t settled;            /* the search ended: the values below stay */
  int64_t trials;             /* trials measured so far (rank 0's count, known everywhere) */
  int64_t fusion_threshold;   /* bytes */
  double cycle_time_ms;
  int64_t shm_chunk_bytes;    /* shared-memory allreduce chunk */
  int32_t hierarchical;       /* 1: the hierarchical allreduce is used where there is one */
} hvdlite_autotune_t;

/* Fills *out; answers at any time (after shutdown: the last values). */
hvdlite_status_t hvdlite_autotune_state(hvdlite_autotune_t* out);

/* Process sets: groups of ranks that negotiate and run collectives of their own,
 * concurrently with other sets (each has its own communicator, response cache,
 * coordinator and fusion). Set 0 is every rank and always exists.
 *
 * hvdlite_add_process_set and hvdlite_remove_process_set are collective over all
 * ranks: every rank calls them, in the same order, with the same arguments (a rank
 * that differs gets HVDLITE_ERR_MISMATCH naming the ranks, on every rank). They
 * block until the change took effect everywhere. */

/* Adds the set of the n global ranks (each in [0, size()), no repeats, any order);
 * *id receives its id, the lowest unused one (the same on every rank).
 * HVDLITE_ERR_INVALID_ARGUMENT for bad ranks or a set of those ranks that exists. */
hvdlite_status_t hvdlite_add_process_set(const int32_t* ranks, int32_t n, int32_t* id);

/* Removes set id (not 0). Ops of the set still in flight fail with an error that
 * names the set. HVDLITE_ERR_INVALID_ARGUMENT for an unknown id or 0. */
hvdlite_status_t hvdlite_remove_process_set(int32_t id);

/* The number of ids (*n) and, into ids (capacity entries), the ids in increasing order. */
hvdlite_status_t hvdlite_process_set_ids(int32_t* ids, int32_t capacity, int32_t* n);

/* Set id's global ranks, in increasing order: *n of them, at most capacity written. */
hvdlite_status_t hvdlite_process_set_ranks(int32_t id, int32_t* ranks, int32_t capacity,
                                           int32_t* n);

/* This process's rank in set id, -1 when it is not a member. */
hvdlite_status_t hvdlite_process_set_rank(int32_t id, int32_t* out);

/* The number of ranks in set id. */
hvdlite_status_t hvdlite_process_set_size(int32_t id, int32_t* out);

/* Switches the timeline at run time (rank 0 writes it). */
hvdlite_status_t hvdlite_start_timeline(const char* path, int32_t mark_cycles);
hvdlite_status_t hvdlite_stop_timeline(void);

/* The calling thread's last error message; never NULL. */
const char* hvdlite_last_error(void);

/* The constant's name, e.g. "HVDLITE_ERR_MISMATCH"; never NULL. */
const char* hvdlite_status_name(hvdlite_status_t status);

/* Library version and the linked MPI library's version string. */
const char* hvdlite_version(void);
hvdlite_status_t hvdlite_mpi_library_version(char* buf, int32_t len);

/* CDEF-END */

#ifdef __cplusplus
}  /* extern "C" */
#endif
