"""The core's GPU paths, run without a GPU: a stand-in CUDA runtime and a stand-in NCCL
(C, compiled here, opened through HVDLITE_CUDART_LIB and HVDLITE_NCCL_LIB) whose
"device memory" is host memory. What this proves on any machine: the run-time loading,
the choice of path per process set with every member (NCCL for one rank with its own
GPU; staged for ranks that share one; the errors when neither can run), the staging of
every op and the NCCL path's packing, scaling and per-op calls, against numpy. The real
CUDA and NCCL run in tests/gpu, on a GPU (scripts/gpu_check.sh).

The stand-in NCCL serves one rank only (a communicator of one: its collectives are
copies, its pre-multiplied sum a scaling), which is all a CPU can check of it.
"""
import os
import subprocess
import sys

import pytest

from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

FAKE_CUDART = r'''
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static int waits = 0;
int cudaSetDevice(int d) { return d == 0 ? 0 : 101; }
int cudaStreamCreateWithFlags(void** s, unsigned f) { *s = (void*)0x5; return 0; }
int cudaStreamDestroy(void* s) { return 0; }
int cudaStreamWaitEvent(void* s, void* e, unsigned f) { waits++; return 0; }
int cudaEventCreateWithFlags(void** e, unsigned f) { *e = calloc(1, sizeof(long)); return 0; }
int cudaEventDestroy(void* e) { free(e); return 0; }

/* With FAKE_ASYNC_STREAM=US the stream is a thread of its own, as a GPU's copy engine
   is to the host: copies run in the order given, after the caller went on, each taking
   US microseconds; an event is done once the stream has passed where it was recorded.
   A core that read a copy's destination before waiting for it would read stale bytes.
   Unset, copies happen at once. */
enum { QUEUE = 1 << 16 };
typedef struct { void* d; const void* s; size_t n; } job;
static job queue[QUEUE];
static long queued, done;  /* jobs given to the stream, jobs it finished */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t moved = PTHREAD_COND_INITIALIZER;
static int async_us = -2;
static void* stream_thread(void* unused) {
  for (;;) {
    pthread_mutex_lock(&mu);
    while (done == queued) pthread_cond_wait(&moved, &mu);
    job j = queue[done % QUEUE];
    pthread_mutex_unlock(&mu);
    if (j.n) { usleep(async_us); memmove(j.d, j.s, j.n); }
    pthread_mutex_lock(&mu);
    done++;
    pthread_cond_broadcast(&moved);
    pthread_mutex_unlock(&mu);
  }
  return 0;
}
static int async_stream(void) {
  if (async_us == -2) {
    const char* v = getenv("FAKE_ASYNC_STREAM");
    async_us = v ? atoi(v) : -1;
    pthread_t t;
    if (async_us >= 0) pthread_create(&t, 0, stream_thread, 0);
  }
  return async_us >= 0;
}
static long give(void* d, const void* s, size_t n) {
  pthread_mutex_lock(&mu);
  while (queued - done >= QUEUE) pthread_cond_wait(&moved, &mu);
  queue[queued % QUEUE] = (job){d, s, n};
  long at = ++queued;
  pthread_cond_broadcast(&moved);
  pthread_mutex_unlock(&mu);
  return at;
}
static void wait_until(long at) {
  pthread_mutex_lock(&mu);
  while (done < at) pthread_cond_wait(&moved, &mu);
  pthread_mutex_unlock(&mu);
}
static int passed(long at) {
  pthread_mutex_lock(&mu);
  int yes = done >= at;
  pthread_mutex_unlock(&mu);
  return yes;
}

/* The core polls its stream's event before it sleeps on it: without the async stream
   the event is not ready for two queries after each record, and never for every fifth
   record (the wait then sleeps, in cudaEventSynchronize). */
static int records, queries_left;
int cudaEventRecord(void* e, void* s) {
  if (async_stream()) { *(long*)e = give(0, 0, 0); return 0; }
  queries_left = ++records % 5 == 0 ? 1 << 30 : 2;
  return 0;
}
int cudaEventQuery(void* e) {
  if (async_stream()) return passed(*(long*)e) ? 0 : 600;
  return queries_left-- > 0 ? 600 : 0;
}
int cudaEventSynchronize(void* e) { if (async_stream()) wait_until(*(long*)e); return 0; }

/* Pinned allocations, to tell a copy's direction: the order of copies down ('d', into
   pinned memory) and up ('u'), read by fake_copy_order. */
static char* pinned_at[64];
static size_t pinned_bytes[64];
static char order[1 << 16];
static int ordered;
static int is_pinned(const void* p) {
  for (int i = 0; i < 64; ++i)
    if (pinned_at[i] && (const char*)p >= pinned_at[i] && (const char*)p < pinned_at[i] + pinned_bytes[i]) return 1;
  return 0;
}
int cudaMemcpyAsync(void* d, const void* s, size_t n, int k, void* st) {
  if (ordered < (int)sizeof(order) && (is_pinned(d) != is_pinned(s))) order[ordered++] = is_pinned(d) ? 'd' : 'u';
  if (async_stream()) give(d, s, n); else memmove(d, s, n);
  return 0;
}
int fake_copy_order(char* out, int n) {
  int k = ordered < n ? ordered : n;
  memcpy(out, order, k);
  ordered = 0;
  return k;
}
int cudaHostAlloc(void** p, size_t n, unsigned f) {
  *p = malloc(n);
  for (int i = 0; *p && i < 64; ++i)
    if (!pinned_at[i]) { pinned_at[i] = *p; pinned_bytes[i] = n; break; }
  return *p ? 0 : 2;
}
/* As the real ones: freeing waits for the stream's work. */
int cudaFreeHost(void* p) {
  if (async_stream()) wait_until(queued);
  for (int i = 0; i < 64; ++i)
    if (pinned_at[i] == p) pinned_at[i] = 0;
  free(p);
  return 0;
}
int cudaMalloc(void** p, size_t n) { *p = malloc(n); return *p ? 0 : 2; }
int cudaFree(void* p) { if (async_stream()) wait_until(queued); free(p); return 0; }
int cudaDeviceGetPCIBusId(char* b, int len, int d) {
  const char* id = getenv("FAKE_GPU_BUS");
  snprintf(b, len, "%s", id ? id : "0000:00:00.0");
  return 0;
}
int cudaRuntimeGetVersion(int* v) { *v = 13000; return 0; }
const char* cudaGetErrorString(int c) { return "stand-in CUDA error"; }
int fake_stream_waits(void) { return waits; }
/* cudaMemcpyBatchAsync, CUDA 13's signature; the attributes as the core must give them
   (one entry for all copies, sources read in stream order). */
typedef struct { int type, id; } loc;
typedef struct { int order; loc src, dst; unsigned flags; } attrs_t;
static int batches = 0;
int cudaMemcpyBatchAsync(const void** d, const void** s, const size_t* n, size_t count,
                         attrs_t* a, size_t* idx, size_t num, void* st) {
  if (num != 1 || idx[0] != 0 || a[0].order != 1 || count < 1) return 1;
  for (size_t i = 0; i < count; ++i) memmove((void*)d[i], s[i], n[i]);
  batches++;
  return 0;
}
int fake_batches(void) { return batches; }
'''

FAKE_DRIVER = r'''
#include <stdint.h>
#include <string.h>
/* The driver calls that load and launch the core's copy kernel; the "kernel" does what
   the PTX does, from the same table: entries of {dst, src, bytes} as u64. */
static int launches = 0;
static int module_token;
int cuModuleLoadData(void** m, const void* image) {
  if (!strstr((const char*)image, ".entry hvdlite_copy_batch(")) return 200;
  *m = &module_token;
  return 0;
}
int cuModuleGetFunction(void** f, void* m, const char* name) {
  if (m != &module_token || strcmp(name, "hvdlite_copy_batch") != 0) return 500;
  *f = &launches;
  return 0;
}
int cuModuleUnload(void* m) { return 0; }
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void* stream, void** params, void** extra) {
  if (f != &launches || gx < 1 || bx != 256 || gy != 1 || gz != 1 || by != 1 || bz != 1) return 1;
  const uint64_t* table = (const uint64_t*)*(uint64_t*)params[0];
  uint32_t count = *(uint32_t*)params[1];
  if (gx > count) return 1;
  for (uint32_t i = 0; i < count; ++i)
    memmove((void*)table[3 * i], (const void*)table[3 * i + 1], table[3 * i + 2]);
  launches++;
  return 0;
}
int fake_launches(void) { return launches; }
'''

FAKE_NCCL = r'''
#include <string.h>
typedef struct { char internal[128]; } ncclUniqueId;
static double factor[64];
static int made = 0;
static const void* sent;
static size_t esize(int t) {
  switch (t) { case 0: case 1: return 1; case 2: case 3: case 7: return 4; case 6: case 9: return 2; }
  return 8;
}
static void scale(void* buf, size_t n, int type, int op) {
  if (op < 16) return;
  double f = factor[op - 16];
  for (size_t i = 0; i < n; ++i) {
    if (type == 7) ((float*)buf)[i] *= (float)f;
    if (type == 8) ((double*)buf)[i] *= f;
  }
}
int ncclGetVersion(int* v) { *v = 22703; return 0; }
int ncclGetUniqueId(ncclUniqueId* id) { memset(id, 7, sizeof *id); return 0; }
int ncclCommInitRank(void** c, int n, ncclUniqueId id, int r) { if (n != 1) return 5; *c = (void*)0xc; return 0; }
int ncclCommDestroy(void* c) { return 0; }
int ncclRedOpCreatePreMulSum(int* op, void* s, int type, int where, void* c) {
  int i = made++ % 64;
  factor[i] = type == 7 ? *(float*)s : type == 8 ? *(double*)s : 1.0;
  *op = 16 + i;
  return 0;
}
int ncclRedOpDestroy(int op, void* c) { return 0; }
int ncclAllReduce(const void* in, void* out, size_t n, int type, int op, void* c, void* s) {
  memmove(out, in, n * esize(type)); scale(out, n, type, op); return 0;
}
int ncclBroadcast(const void* in, void* out, size_t n, int type, int root, void* c, void* s) {
  memmove(out, in, n * esize(type)); return 0;
}
int ncclReduce(const void* in, void* out, size_t n, int type, int op, int root, void* c, void* s) {
  memmove(out, in, n * esize(type)); scale(out, n, type, op); return 0;
}
int ncclSend(const void* in, size_t n, int type, int peer, void* c, void* s) { sent = in; return 0; }
int ncclRecv(void* out, size_t n, int type, int peer, void* c, void* s) { memmove(out, sent, n * esize(type)); return 0; }
int ncclGroupStart(void) { return 0; }
int ncclGroupEnd(void) { return 0; }
const char* ncclGetErrorString(int r) { return "stand-in NCCL error"; }
'''

PRELUDE = r'''
import ctypes, json, os
import numpy as np
import hvdlite as hvd
from hvdlite import _enqueue, dtypes, errors

failures, checks = [], [0]
EVENT = np.zeros(1)  # any address: the stand-in runtime only counts the waits


def check(label, ok, detail=""):
    checks[0] += 1
    if not ok:
        failures.append(f"{label}: {detail}")


def close(label, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        check(label, False, f"shape {got.shape}, want {want.shape}")
        return
    wrong = np.flatnonzero(~np.isclose(got, want))
    check(label, wrong.size == 0, f"{wrong.size} of {got.size} wrong, first at "
          f"{wrong[:5].tolist()}: got {got.flat[wrong[:5]].tolist()} want "
          f"{want.flat[wrong[:5]].tolist()}")


def on_gpu(op, name, x, out=None, gather=False, **kw):
    """op on x as if it were in GPU memory (device 0), waiting for the result."""
    code = dtypes.native_code(x.dtype.name)
    finisher = None
    if gather:
        finisher = lambda h: h.output_array(0, x.dtype, x.shape[1:]).copy()
    h = _enqueue.enqueue(op, name, code, x.shape, x.ctypes.data,
                         None if out is None else out.ctypes.data, device=0,
                         ready_event=EVENT.ctypes.data, keepalive=(x, out),
                         finisher=finisher, result=out, **kw)
    return hvd.synchronize(h)


def data(r, shape, salt=0, dtype=np.float64):
    n = int(np.prod(shape))
    return ((np.arange(n) * 3 + r * 5 + salt * 7) % 17 - 8).astype(dtype).reshape(shape)


def report(**extra):
    hvd.barrier()
    print("HVDLITE_RESULT", json.dumps({"failures": failures, "checks": checks[0], **extra}),
          flush=True)
'''

OPS = PRELUDE + r'''
hvd.init()
rank, size = hvd.rank(), hvd.size()
ranks = range(size)
for dtype in (np.float32, np.float64, np.int32):
    tag = np.dtype(dtype).name
    x = data(rank, (5, 3), dtype=dtype)
    out = np.empty_like(x)
    close(f"{tag} sum", on_gpu(_enqueue.ALLREDUCE, f"{tag}.sum", x, out, reduce_op=_enqueue.Sum),
          sum(data(r, (5, 3), dtype=dtype) for r in ranks))
    out = np.empty_like(x)
    close(f"{tag} max", on_gpu(_enqueue.ALLREDUCE, f"{tag}.max", x, out,
                               reduce_op=_enqueue.Max),
          np.max([data(r, (5, 3), dtype=dtype) for r in ranks], axis=0))
    if dtype != np.int32:
        out = np.empty_like(x)
        close(f"{tag} scaled average",
              on_gpu(_enqueue.ALLREDUCE, f"{tag}.avg", x, out, reduce_op=_enqueue.Average,
                     prescale=2.0, postscale=0.25),
              sum(data(r, (5, 3), dtype=dtype) for r in ranks) * 0.5 / size)
    else:
        out = np.empty_like(x)  # integer Average: truncating division, staged even under NCCL
        close(f"{tag} average", on_gpu(_enqueue.ALLREDUCE, f"{tag}.avg", x, out,
                                       reduce_op=_enqueue.Average),
              np.trunc(sum(data(r, (5, 3), dtype=dtype) for r in ranks) / size).astype(dtype))
    mine = data(rank, (rank + 1, 3), dtype=dtype)
    close(f"{tag} allgather", on_gpu(_enqueue.ALLGATHER, f"{tag}.gather", mine, gather=True),
          np.concatenate([data(r, (r + 1, 3), dtype=dtype) for r in ranks]))
    for root in ranks:
        out = np.empty_like(x)
        close(f"{tag} broadcast {root}",
              on_gpu(_enqueue.BROADCAST, f"{tag}.bcast{root}", x, out, root_rank=root),
              data(root, (5, 3), dtype=dtype))
    rows = data(rank, (2 * size + 1, 3), dtype=dtype)
    mine_rows = (2 * size + 1) // size + (1 if rank < (2 * size + 1) % size else 0)
    out = np.empty((mine_rows, 3), dtype=dtype)
    total = sum(data(r, (2 * size + 1, 3), dtype=dtype) for r in ranks)
    start = sum((2 * size + 1) // size + (1 if k < (2 * size + 1) % size else 0)
                for k in range(rank))
    close(f"{tag} reducescatter",
          on_gpu(_enqueue.REDUCESCATTER, f"{tag}.rs", rows, out, reduce_op=_enqueue.Sum),
          total[start:start + mine_rows])
    splits = [rank + k + 1 for k in ranks]
    send = data(rank, (sum(splits), 2), dtype=dtype)
    got = on_gpu(_enqueue.ALLTOALL, f"{tag}.a2a", send, gather=True, splits=splits)
    want = []
    for r in ranks:
        theirs = data(r, (sum(r + k + 1 for k in ranks), 2), dtype=dtype)
        at = sum(r + k + 1 for k in range(rank))
        want.append(theirs[at:at + r + rank + 1])
    close(f"{tag} alltoall", got, np.concatenate(want))
# A fused run: several allreduces submitted together (one group).
xs = [data(rank, (4 + i,), salt=i) for i in range(3)]
outs = [np.empty_like(x) for x in xs]
specs = [_enqueue.TensorSpec(_enqueue.ALLREDUCE, f"fused.{i}", dtypes.native_code("float64"),
                             x.shape, x.ctypes.data, o.ctypes.data, _enqueue.Sum, device=0,
                             ready_event=EVENT.ctypes.data) for i, (x, o) in enumerate(zip(xs, outs))]
hvd.synchronize(_enqueue.enqueue_group(specs, name="fused", keepalive=(xs, outs)))
for i, o in enumerate(outs):
    close(f"fused {i}", o, sum(data(r, (4 + i,), salt=i) for r in ranks))
# Host tensors still run beside GPU ones.
close("host", hvd.allreduce(data(rank, (3,)), op=hvd.Sum), sum(data(r, (3,)) for r in ranks))
cudart = ctypes.CDLL(os.environ["HVDLITE_CUDART_LIB"])
check("the core's stream waited on the framework's events", cudart.fake_stream_waits() > 0,
      str(cudart.fake_stream_waits()))
driver = os.environ.get("HVDLITE_CUDA_LIB")
launches = ctypes.CDLL(driver).fake_launches() if driver else 0
report(stats=hvd.stats(), batches=cudart.fake_batches(), launches=launches)
'''

PIPELINE = PRELUDE + r'''
# Staged allreduces cut into chunks of HVDLITE_GPU_STAGE_CHUNK bytes, on a stand-in
# stream that copies behind the caller's back (FAKE_ASYNC_STREAM): every result against
# numpy, three rounds with new values (a chunk read before its copy landed would hold
# the round before's bytes).
hvd.init()
rank, size = hvd.rank(), hvd.size()
ranks = range(size)
cudart = ctypes.CDLL(os.environ["HVDLITE_CUDART_LIB"])
order = ctypes.create_string_buffer(1 << 16)
cudart.fake_copy_order(order, len(order))
chunk = int(os.environ["HVDLITE_GPU_STAGE_CHUNK"])
copies = {}
for it in range(3):
    n = 100003  # not a multiple of the chunk
    big = data(rank, (n,), salt=it, dtype=np.float32)
    out = np.empty_like(big)
    close(f"round {it}: float32 sum of {n}",
          on_gpu(_enqueue.ALLREDUCE, f"big.{it}", big, out, reduce_op=_enqueue.Sum),
          sum(data(r, (n,), salt=it, dtype=np.float32) for r in ranks))
    got = cudart.fake_copy_order(order, len(order))
    copies.setdefault("big", order.raw[:got].decode())
    x = data(rank, (3001,), salt=it)
    on_gpu(_enqueue.ALLREDUCE, f"inplace.{it}", x, x, reduce_op=_enqueue.Average,
           prescale=2.0, postscale=0.25)
    close(f"round {it}: in place, scaled average", x,
          sum(data(r, (3001,), salt=it) for r in ranks) * 0.5 / size)
    m = data(rank, (2500,), salt=it, dtype=np.int32) * (rank + 1)
    close(f"round {it}: int32 max",
          on_gpu(_enqueue.ALLREDUCE, f"max.{it}", m, np.empty_like(m), reduce_op=_enqueue.Max),
          np.max([data(r, (2500,), salt=it, dtype=np.int32) * (r + 1) for r in ranks], axis=0))
    # A group whose tensors straddle chunk edges, an empty one among them.
    lengths = [1000, 1, 0, 3000, 7, 513]
    xs = [data(rank, (k,), salt=it + i) for i, k in enumerate(lengths)]
    outs = [np.empty_like(v) for v in xs]
    specs = [_enqueue.TensorSpec(_enqueue.ALLREDUCE, f"group.{it}.{i}",
                                 dtypes.native_code("float64"), v.shape, v.ctypes.data,
                                 o.ctypes.data, _enqueue.Sum, device=0,
                                 ready_event=EVENT.ctypes.data)
             for i, (v, o) in enumerate(zip(xs, outs))]
    hvd.synchronize(_enqueue.enqueue_group(specs, name=f"group.{it}", keepalive=(xs, outs)))
    for i, (k, o) in enumerate(zip(lengths, outs)):
        close(f"round {it}: group member {i} ({k} elements)", o,
              sum(data(r, (k,), salt=it + i) for r in ranks))
report(stats=hvd.stats(), copies=copies)
'''

REFUSED = PRELUDE + r'''
hvd.init()
rank, size = hvd.rank(), hvd.size()
x = data(rank, (4,))
for attempt in range(2):  # every later GPU op of the set gets the same answer
    try:
        on_gpu(_enqueue.ALLREDUCE, f"refused.{attempt}", x, np.empty_like(x),
               reduce_op=_enqueue.Sum)
    except errors.InvalidArgumentError as e:
        for word in os.environ["EXPECT"].split("|"):
            check(f"message names {word!r}", word in str(e), str(e))
    else:
        check("refused", False, "a GPU op ran")
# The job stays usable for host tensors.
close("host after", hvd.allreduce(x, op=hvd.Sum), sum(data(r, (4,)) for r in range(size)))
report()
'''


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    where = tmp_path_factory.mktemp("fake_gpu")
    libs = {}
    for name, source in (("cudart", FAKE_CUDART), ("nccl", FAKE_NCCL), ("driver", FAKE_DRIVER)):
        src = where / f"fake_{name}.c"
        src.write_text(source)
        lib = where / f"libfake_{name}.so"
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-pthread", "-o", str(lib), str(src)],
                       check=True)
        libs[name] = str(lib)
    return libs


def _outcomes(result, np_):
    assert_ok(result)
    problems, outcomes = [], {}
    for r in range(np_):
        outcome = result.result(r)
        outcomes[r] = outcome
        if outcome["checks"] < 1:
            problems.append(f"rank {r} made no checks")
        problems += [f"rank {r}: {f}" for f in outcome["failures"]]
    assert not problems, "\n".join(problems) + "\n" + describe(result)
    return outcomes


@pytest.mark.parametrize("pack", ["kernel", "batch", "copies"])
def test_one_rank_with_its_own_gpu_runs_every_op_through_nccl(fakes, pack):
    env = {"HVDLITE_CUDART_LIB": fakes["cudart"], "HVDLITE_NCCL_LIB": fakes["nccl"],
           "HVDLITE_CUDA_LIB": fakes["driver"], "HVDLITE_LOG_LEVEL": "INFO",
           "HVDLITE_GPU_PACK": pack}
    result = run_job(1, OPS, env=env, timeout=120)
    outcome = _outcomes(result, 1)[0]
    stats = outcome["stats"]
    assert stats["nccl_collectives"] >= 15, stats
    assert stats["nccl_us"] > 0, stats
    # The fused allreduce's pack and unpack: a kernel launch each, or a batched copy each,
    # or neither (one copy per tensor), as asked; the results were checked either way.
    assert (outcome["launches"], outcome["batches"]) == \
        {"kernel": (2, 0), "batch": (0, 2), "copies": (0, 0)}[pack], outcome
    method = {"kernel": "the core's copy kernel", "batch": "cudaMemcpyBatchAsync",
              "copies": "one cudaMemcpyAsync per tensor"}[pack]
    assert f"fused tensors packed with {method}" in result.stderr, describe(result)
    # Integer Average (floor division) is not NCCL's: staged, also on an NCCL set.
    assert stats["staged_collectives"] >= 1, stats
    assert "through NCCL 2.27.3" in result.stderr, describe(result)


@pytest.mark.parametrize("np_", [2, 3])
def test_ranks_sharing_a_gpu_stage_every_op_through_host_memory(fakes, np_):
    env = {"HVDLITE_CUDART_LIB": fakes["cudart"], "HVDLITE_NCCL_LIB": fakes["nccl"],
           "HVDLITE_LOG_LEVEL": "INFO"}
    result = run_job(np_, OPS, env=env, timeout=150)
    outcomes = _outcomes(result, np_)
    for r in range(np_):
        stats = outcomes[r]["stats"]
        assert stats["nccl_collectives"] == 0 and stats["staged_collectives"] >= 15, stats
    assert "share the GPU" in result.stderr and "staged through host memory" in result.stderr, \
        describe(result)


@pytest.mark.parametrize("np_,chunk", [(2, 4096), (3, 4096), (2, 0)])
def test_a_staged_allreduce_overlaps_its_copies_chunk_by_chunk(fakes, np_, chunk):
    env = {"HVDLITE_CUDART_LIB": fakes["cudart"], "HVDLITE_NCCL_LIB": fakes["nccl"],
           "HVDLITE_GPU_STAGE_CHUNK": str(chunk), "FAKE_ASYNC_STREAM": "100"}
    outcomes = _outcomes(run_job(np_, PIPELINE, env=env, timeout=150), np_)
    for r in range(np_):
        stats = outcomes[r]["stats"]
        assert stats["nccl_collectives"] == 0 and stats["staged_collectives"] == 12, stats
        # The 100003 float32 (400012 bytes): one copy down and one up per chunk; with
        # chunks, results go up before the last chunk comes down (the pipeline), with
        # one piece (chunk 0) every copy down comes first.
        order = outcomes[r]["copies"]["big"]
        chunks = -(-100003 * 4 // chunk) if chunk else 1
        assert order.count("d") == chunks and order.count("u") == chunks, order
        if chunk:
            assert order.index("u") < order.rindex("d"), order
            assert order.startswith("dd") and order.endswith("u") and "ddd" not in order, order


def test_gpu_operations_mpi_stages_even_where_nccl_could_run(fakes):
    env = {"HVDLITE_CUDART_LIB": fakes["cudart"], "HVDLITE_NCCL_LIB": fakes["nccl"],
           "HOROVOD_GPU_OPERATIONS": "MPI"}
    stats = _outcomes(run_job(1, OPS, env=env, timeout=120), 1)[0]["stats"]
    assert stats["nccl_collectives"] == 0 and stats["staged_collectives"] >= 15, stats


@pytest.mark.parametrize("case", ["nccl_forced_on_a_shared_gpu", "no_cuda_runtime"])
def test_a_gpu_op_that_cannot_run_is_refused_on_every_rank_with_the_reason(fakes, case):
    if case == "nccl_forced_on_a_shared_gpu":
        env = {"HVDLITE_CUDART_LIB": fakes["cudart"], "HVDLITE_NCCL_LIB": fakes["nccl"],
               "HVDLITE_GPU_OPERATIONS": "NCCL",
               "EXPECT": "ranks 0, 1 share the GPU|HVDLITE_GPU_OPERATIONS=NCCL|unset it"}
    else:
        env = {"HVDLITE_CUDART_LIB": "/nonexistent/libcudart.so",
               "EXPECT": "ranks 0, 1 could not use a GPU|/nonexistent/libcudart.so"}
    _outcomes(run_job(2, REFUSED, env=env, timeout=120), 2)


@pytest.mark.parametrize("found", [True, False])
def test_cuda_built_and_nccl_built_say_whether_the_core_opens_them(fakes, found):
    # Horovod's queries; hvdlite links neither library, so they ask the core whether it
    # opens them here (no init, no GPU needed).
    env = dict(os.environ, HVDLITE_CUDART_LIB=fakes["cudart"] if found else "/nonexistent.so",
               HVDLITE_NCCL_LIB=fakes["nccl"])
    code = ("import hvdlite.torch as hvd; "
            "print(hvd.cuda_built(), hvd.nccl_built(), hvd.gpu_available('torch'), "
            "hvd.gpu_available('tensorflow'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    # The stand-in runtime is CUDA 13.0 and the stand-in NCCL 2.27.3.
    want = "True 22703 True False" if found else "False 0 False False"
    assert out.stdout.split() == want.split(), out.stdout


def test_a_bad_gpu_operations_value_fails_init_naming_it():
    result = run_job(1, "import hvdlite as hvd\nhvd.init()\n",
                     env={"HVDLITE_GPU_OPERATIONS": "GLOO"}, timeout=60)
    assert result.returncode != 0 and "HVDLITE_GPU_OPERATIONS='GLOO'" in result.stderr, \
        describe(result)
