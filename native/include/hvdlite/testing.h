/*
 * hvdlite test-only entry points: NOT part of the public C API.
 *
 * They expose pieces of the core that have no transport (the wire format, the
 * coordinator's decisions) so that tests/faults can drive them with random inputs
 * (hypothesis) in one process, without MPI. Nothing here is stable; user code must not
 * call it. Every function follows c_api.h's conventions: a status code, results
 * through out-pointers, hvdlite_last_error() on failure.
 *
 * hvdlite/_native.py also hands the block between the CDEF markers to cffi.
 */
#pragma once

#include <stdint.h>

#include "hvdlite/c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CDEF-BEGIN */

/* Parses a serialized request list (the rank -> coordinator message) and serializes
 * the result again into out (capacity out_cap). The input is first copied to the end
 * of a page followed by an inaccessible guard page, so a read past its end crashes
 * instead of going unnoticed. *count receives the number of requests, *out_len the
 * bytes written (or, with HVDLITE_ERR_INVALID_ARGUMENT and a message saying so, the
 * capacity needed). A corrupted or truncated message is HVDLITE_ERR_INTERNAL. */
hvdlite_status_t hvdlite_test_roundtrip_requests(const uint8_t* in, int64_t len,
                                                 uint8_t* out, int64_t out_cap,
                                                 int64_t* out_len, int32_t* count);

/* The same for a response list (the coordinator -> every rank message). */
hvdlite_status_t hvdlite_test_roundtrip_responses(const uint8_t* in, int64_t len,
                                                  uint8_t* out, int64_t out_cap,
                                                  int64_t* out_len, int32_t* count);

/* A coordinator (rank 0's Controller) for `size` simulated ranks, with the given stall
 * times in seconds (0: off). *out receives an id for the calls below. */
hvdlite_status_t hvdlite_test_controller_new(int32_t size, double stall_check_s,
                                             double stall_shutdown_s, int64_t* out);

/* Feeds a serialized request list (each request names its rank) to the coordinator,
 * as arrived at simulated time now_s (seconds since the controller was made). */
hvdlite_status_t hvdlite_test_controller_add(int64_t id, const uint8_t* requests, int64_t len,
                                             double now_s);

/* Runs the coordinator's decision at time now_s and writes the serialized response
 * list into out, as it would be broadcast; *out_len as for the round trips. A call
 * whose out_cap is too small decides nothing: call again with the capacity needed. */
hvdlite_status_t hvdlite_test_controller_build(int64_t id, double now_s, uint8_t* out,
                                               int64_t out_cap, int64_t* out_len);

/* The number of tensors the coordinator still waits on. */
hvdlite_status_t hvdlite_test_controller_pending(int64_t id, int64_t* out);

/* Forgets a controller. Unknown ids are a no-op. */
hvdlite_status_t hvdlite_test_controller_free(int64_t id);

/* One step of the "many small tensors" benchmark with no Python in the loop, to tell
 * the core's cost from the per-call cost of the Python front end: enqueues an allreduce
 * (Sum) of each float32 buffer ins[i] into outs[i] (`elements` each), named
 * "<prefix>.<i>", through the public C API, then waits for and releases every handle.
 * Returns the first failure (after waiting for everything enqueued). */
hvdlite_status_t hvdlite_test_allreduce_step(int32_t n, void** ins, void** outs,
                                             int64_t elements, const char* prefix);

/* The tensor queue alone (no MPI, no background thread): a cycle takes the pending
 * list, a tensor is added, and a response removes its entry before the next cycle
 * takes the list (a joined rank, a stall, a failed group can do that). *pending_after
 * receives how many entries that next cycle is handed: 0, as the removed entry must
 * have left the pending list with it. */
hvdlite_status_t hvdlite_test_queue_remove_pending(int64_t* pending_after);

/* Makes the background thread's next MPI call fault (a SIGSEGV on a null pointer,
 * inside the call's guard) as MPICH's error path does after a lost peer: the thread
 * must be parked with a message on stderr, and the process must live on. */
hvdlite_status_t hvdlite_test_fault_in_mpi(void);

/* The same for the next MPI call of a framework thread that runs its own blocking
 * call's cycle (Core::RunCallerCycle across hosts), delay_s after that call began (the
 * thread holding the cycle token meanwhile): that thread must leave the cycle by its
 * escape with the message on stderr; no cycle runs after it, and the ops fail. */
hvdlite_status_t hvdlite_test_fault_in_caller_cycle(double delay_s);

/* Autotune's search alone (KnobSearch: no clocks, no MPI), replayed from the start:
 * starting at the defaults (fusion threshold 128 MiB, cycle time 1 ms, the largest
 * shared-memory chunk, hierarchical on), with a hierarchy to switch off if `hierarchy`,
 * the knobs in `fixed` kept (bits: 1 fusion threshold, 2 cycle time, 4 hierarchical, 8
 * the chunk, as where allreduces do not go through shared memory),
 * at most max_trials trials, it gives scores[i] to its i-th trial. candidates (capacity
 * cap) receives the trials scored, then the next one to measure unless the search
 * ended; *count their number; *done whether it ended; *best the best so far. */
hvdlite_status_t hvdlite_test_knob_search(int32_t hierarchy, int32_t fixed, int64_t max_trials,
                                          const double* scores, int64_t n_scores,
                                          hvdlite_autotune_t* candidates, int64_t cap,
                                          int64_t* count, int32_t* done, hvdlite_autotune_t* best);

/* The timeline alone (no MPI, no background loop): records `steps` steps of a fused
 * allreduce over `tensors` tracks named "t.<i>" on the response-cache path, with the
 * calls the loop makes (per track and step: a NEGOTIATE_ALLREDUCE span with its "rank 0
 * ready" and "all ranks ready" marks, then an ALLREDUCE span holding QUEUE and
 * SHM_ALLREDUCE activities) into a ring of ring_words 32-bit words, and writes them to
 * path. hold_writer != 0: the writer takes nothing until every step is recorded, so a
 * ring smaller than the steps overflows. drain_every > 0: after that many steps, waits
 * until the writer has written everything so far (the ring then wraps without loss).
 * *asked receives the per-track lines the steps asked for other than E (an E follows
 * its B), *dropped those the timeline dropped. */
hvdlite_status_t hvdlite_test_timeline_steps(const char* path, int32_t tensors, int32_t steps,
                                             int64_t ring_words, int32_t hold_writer,
                                             int32_t drain_every, int64_t* asked,
                                             int64_t* dropped);

/* CDEF-END */

#ifdef __cplusplus
}  /* extern "C" */
#endif
