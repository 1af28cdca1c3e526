"""Every error path of the core's allreduce in real 2- and 3-rank jobs.

Mismatches (shape, dtype, op, prescale, postscale; fresh and after the tensor was
cached; alone and inside an async batch) must raise MismatchError on every rank with a
message naming the tensor, the ranks and what differed, and leave the job usable.
Refusals at the call (name in flight, unsupported dtype, non-contiguous array, bool
arithmetic), use before init and after shutdown, and a shutdown by one rank while the
others wait, end with the documented exception rather than a hang.

Ranks record what each call raised on an ``HVDLITE_RESULT`` line; the asserts are here.
"""
import pytest

import harness

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

RANKS = (2, 3)
DEFAULTS = {"HVDLITE_FUSION_THRESHOLD": None, "HVDLITE_CACHE_CAPACITY": None,
            "HVDLITE_CYCLE_TIME": None, "HVDLITE_STALL_CHECK_TIME": None,
            "HVDLITE_STALL_SHUTDOWN_TIME": None, "HVDLITE_TIMELINE": None}
CACHE = {"cache_on": {}, "cache_off": {"HVDLITE_CACHE_CAPACITY": "0"}}

# property -> (what the message calls it, majority's value, last rank's value, the
# keyword arguments for allreduce: (x, op, prescale, postscale) per side).
MISMATCHES = {
    "shape": ("shapes", "shape [4]", "shape [2, 2]"),
    "dtype": ("data types", "float32", "float64"),
    "op": ("reduction ops", "Sum", "Max"),
    "prescale": ("scale factors", "prescale 1, postscale 1", "prescale 2, postscale 1"),
    "postscale": ("scale factors", "prescale 1, postscale 1", "prescale 1, postscale 0.5"),
}

ERRORS_SCRIPT = r"""
import json, time
import numpy as np
import hvdlite as hvd
from hvdlite import errors

out = {}

def record(case, fn):
    try:
        value = fn()
    except Exception as e:
        out[case] = {"type": type(e).__name__, "message": str(e),
                     "internal": isinstance(e, errors.HorovodInternalError)}
        return None
    out[case] = {"type": None}
    return value

def expect_value(case, got, want):
    out[case] = {"type": None, "ok": bool(np.array_equal(got, want)),
                 "got": np.asarray(got).tolist()}

# -- before init --------------------------------------------------------------------
record("before_init_allreduce", lambda: hvd.allreduce(np.ones(2), name="early"))
record("before_init_rank", hvd.rank)

hvd.init()
rank, size = hvd.rank(), hvd.size()
odd = rank == size - 1  # the last rank disagrees
rank_sum = size * (size - 1) // 2

def side(prop):
    # (array, op, prescale, postscale) this rank submits for a mismatch on prop.
    x, op, pre, post = np.ones(4, np.float32), hvd.Sum, 1.0, 1.0
    if odd:
        if prop == "shape": x = np.ones((2, 2), np.float32)
        if prop == "dtype": x = np.ones(4, np.float64)
        if prop == "op": op = hvd.Max
        if prop == "prescale": pre = 2.0
        if prop == "postscale": post = 0.5
    return x, op, pre, post

def agreed(name):
    # An allreduce every rank agrees on; checks its value.
    got = hvd.allreduce(np.full(3, rank + 1.0, np.float32), name=name, op=hvd.Sum)
    expect_value(name, got, np.full(3, rank_sum + size, np.float32))

PROPS = ("shape", "dtype", "op", "prescale", "postscale")

# -- fresh mismatches ---------------------------------------------------------------
for prop in PROPS:
    x, op, pre, post = side(prop)
    record(f"mismatch.{prop}", lambda: hvd.allreduce(x, name=f"bad.{prop}", op=op,
                                                     prescale_factor=pre,
                                                     postscale_factor=post))
    agreed(f"after.{prop}")

# -- mismatches on a tensor negotiated (and cached) before --------------------------
for prop in PROPS:
    name = f"cached.{prop}"
    for step in range(2):
        got = hvd.allreduce(np.ones(4, np.float32), name=name, op=hvd.Sum)
        expect_value(f"cached_ok.{prop}.{step}", got, np.full(4, size, np.float32))
    x, op, pre, post = side(prop)
    record(f"cached_mismatch.{prop}", lambda: hvd.allreduce(
        x, name=name, op=op, prescale_factor=pre, postscale_factor=post))
    # The same name with the agreed properties works again.
    got = hvd.allreduce(np.ones(4, np.float32), name=name, op=hvd.Sum)
    expect_value(f"cached_again.{prop}", got, np.full(4, size, np.float32))

# -- one bad tensor inside an async batch: the others are unaffected ----------------
handles = {}
for i in range(12):
    if i == 5:
        x, op, pre, post = side("shape")
        handles[i] = hvd.allreduce_async(x, name="batch.bad", op=op)
    else:
        handles[i] = hvd.allreduce_async(np.full(8, rank + i, np.float32),
                                         name=f"batch.{i}", op=hvd.Sum)
for i in range(12):
    if i == 5:
        record("batch_mismatch", lambda: hvd.synchronize(handles[5]))
    else:
        expect_value(f"batch.{i}", hvd.synchronize(handles[i]),
                     np.full(8, rank_sum + size * i, np.float32))

# -- a name already in flight -------------------------------------------------------
# The duplicate is tried while the first op surely waits for a rank that has not
# submitted it yet: the late ranks submit it only after a barrier that the probing
# ranks enter after their probe. On "dup.a" the last rank is late, on "dup.b" the others.
probe = "dup.b" if odd else "dup.a"
first = {}
def submit(name):
    first[name] = hvd.allreduce_async(np.full(2, rank, np.int32), name=name, op=hvd.Sum)
if odd:
    hvd.barrier()
    submit("dup.a")
    submit("dup.b")
    record("duplicate", lambda: hvd.allreduce_async(np.ones(2, np.int32), name=probe))
    hvd.barrier()
else:
    submit("dup.a")
    record("duplicate", lambda: hvd.allreduce_async(np.ones(2, np.int32), name=probe))
    hvd.barrier()
    hvd.barrier()
    submit("dup.b")
out["duplicate"]["probe"] = probe
for name in ("dup.a", "dup.b"):
    expect_value(f"duplicate_first.{name}", hvd.synchronize(first[name]),
                 np.full(2, rank_sum, np.int32))
# Once ended, the names can be used again.
for name in ("dup.a", "dup.b"):
    expect_value(f"duplicate_reuse.{name}",
                 hvd.allreduce(np.full(2, rank, np.int32), name=name, op=hvd.Sum),
                 np.full(2, rank_sum, np.int32))

# -- refused at the call ------------------------------------------------------------
BAD = {
    "dtype.complex64": lambda: np.ones(3, np.complex64),
    "dtype.uint64": lambda: np.ones(3, np.uint64),
    "dtype.uint32": lambda: np.ones(3, np.uint32),
    "dtype.object": lambda: np.array([1, "a"], dtype=object),
    "dtype.bigendian": lambda: np.ones(3, ">f4"),
    "layout.strided": lambda: np.arange(10, dtype=np.float32)[::2],
    "layout.fortran": lambda: np.asfortranarray(np.ones((3, 4), np.float32)),
    "layout.transposed": lambda: np.ones((3, 4), np.float64).T,
}
for case, make in BAD.items():
    record(f"refused.{case}", lambda: hvd.allreduce(make(), name=f"refused.{case}",
                                                    op=hvd.Max))
record("refused.bool_sum", lambda: hvd.allreduce(np.ones(3, bool), name="refused.bool_sum",
                                                 op=hvd.Sum))
record("refused.bool_average", lambda: hvd.allreduce(np.ones(3, bool),
                                                     name="refused.bool_average"))
record("refused.bool_scaled", lambda: hvd.allreduce(np.ones(3, bool), name="refused.bool_scaled",
                                                    op=hvd.Max, prescale_factor=2.0))
record("refused.op", lambda: hvd.allreduce(np.ones(3, np.float32), name="refused.op", op=42))
agreed("after.refusals")

# -- shutdown by rank 0 while the others wait for it --------------------------------
# The barrier: every other rank has its op in flight before rank 0 shuts down (else its
# allreduce_async could meet the ended core and raise outside record()).
if rank == 0:
    orphan = hvd.allreduce_async(np.ones(2, np.float32), name="orphan", op=hvd.Sum)
    hvd.barrier()
    time.sleep(0.5)
    started = time.monotonic()
    hvd.shutdown()
    out["shutdown_s"] = time.monotonic() - started
    record("pending_at_shutdown", lambda: hvd.synchronize(orphan, timeout=30))
else:
    waiting = hvd.allreduce_async(np.ones(2, np.float32), name="waits.for.rank0",
                                  op=hvd.Sum)
    hvd.barrier()
    started = time.monotonic()
    record("pending_at_shutdown", lambda: hvd.synchronize(waiting, timeout=30))
    out["waited_s"] = time.monotonic() - started
    # The core stopped under this rank: new work fails at once, not after a timeout.
    record("enqueue_after_remote_shutdown",
           lambda: hvd.allreduce(np.ones(2, np.float32), name="late", op=hvd.Sum))
    hvd.shutdown()
record("shutdown_again", hvd.shutdown)
out["is_initialized_after"] = hvd.is_initialized()
record("after_shutdown_allreduce", lambda: hvd.allreduce(np.ones(2), name="after"))
record("after_shutdown_async", lambda: hvd.allreduce_async(np.ones(2), name="after2"))
record("after_shutdown_rank", hvd.rank)
print("HVDLITE_RESULT", json.dumps({"kind": "errors", "rank": rank, "size": size,
                                    "out": out}))
"""


def rank_words(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


@pytest.fixture(scope="module", params=[(n, c) for n in RANKS for c in sorted(CACHE)],
                ids=lambda p: f"{p[0]}-{p[1]}")
def errors_job(request):
    """One job per (ranks, cache setting); returns (size, {rank: recorded outcomes})."""
    np_, cache = request.param
    env = dict(DEFAULTS)
    env.update(CACHE[cache])
    job = harness.assert_ok(harness.run_job(np_, ERRORS_SCRIPT, timeout=120, env=env))
    outs = {}
    for rank in range(np_):
        res = [r for r in job.results.get(rank, []) if r.get("kind") == "errors"]
        assert res, f"rank {rank} reported nothing\n" + harness.describe(job)
        outs[rank] = res[-1]["out"]
    return np_, outs


def _every_rank(outs, case):
    return [(rank, out[case]) for rank, out in sorted(outs.items())]


@pytest.mark.parametrize("prop", sorted(MISMATCHES))
@pytest.mark.parametrize("where", ["mismatch", "cached_mismatch"])
def test_mismatch_raises_on_every_rank_naming_tensor_ranks_and_difference(
        errors_job, prop, where):
    size, outs = errors_job
    what, majority_value, odd_value = MISMATCHES[prop]
    tensor = f"bad.{prop}" if where == "mismatch" else f"cached.{prop}"
    majority, odd = rank_words(range(size - 1)), rank_words([size - 1])
    messages = set()
    for rank, got in _every_rank(outs, f"{where}.{prop}"):
        assert got["type"] == "MismatchError", f"rank {rank}: {got}"
        assert got["internal"], "MismatchError must be a HorovodInternalError"
        msg = got["message"]
        assert f"Mismatched {what}" in msg, msg
        assert f"'{tensor}'" in msg, msg
        assert f"{majority} had {majority_value}" in msg, msg
        assert f"{odd} had {odd_value}" in msg, msg
        messages.add(msg)
    assert len(messages) == 1, f"ranks got different messages: {messages}"


@pytest.mark.parametrize("prop", sorted(MISMATCHES))
def test_job_usable_after_mismatch(errors_job, prop):
    size, outs = errors_job
    for case in (f"after.{prop}", f"cached_ok.{prop}.0", f"cached_ok.{prop}.1",
                 f"cached_again.{prop}"):
        for rank, got in _every_rank(outs, case):
            assert got["type"] is None and got["ok"], f"rank {rank} {case}: {got}"


def test_mismatch_inside_batch_fails_only_that_tensor(errors_job):
    size, outs = errors_job
    for rank, got in _every_rank(outs, "batch_mismatch"):
        assert got["type"] == "MismatchError", f"rank {rank}: {got}"
        assert "'batch.bad'" in got["message"], got
    for i in range(12):
        if i != 5:
            for rank, got in _every_rank(outs, f"batch.{i}"):
                assert got["ok"], f"rank {rank} batch.{i}: {got}"


def test_name_in_flight_is_refused_and_first_op_completes(errors_job):
    size, outs = errors_job
    for rank, got in _every_rank(outs, "duplicate"):
        assert got["type"] == "DuplicateNameError", f"rank {rank}: {got}"
        assert f"'{got['probe']}'" in got["message"] and "in flight" in got["message"], got
    for case in ("duplicate_first.dup.a", "duplicate_first.dup.b", "duplicate_reuse.dup.a",
                 "duplicate_reuse.dup.b"):
        for rank, got in _every_rank(outs, case):
            assert got["ok"], f"rank {rank} {case}: {got}"


@pytest.mark.parametrize("case,needle", [
    ("dtype.complex64", "unsupported dtype"), ("dtype.uint64", "unsupported dtype"),
    ("dtype.uint32", "unsupported dtype"), ("dtype.object", "unsupported dtype"),
    ("dtype.bigendian", "unsupported dtype"), ("layout.strided", "not C-contiguous"),
    ("layout.fortran", "not C-contiguous"), ("layout.transposed", "not C-contiguous"),
    ("bool_sum", "Min and Max"), ("bool_average", "Min and Max"),
    ("bool_scaled", "scaled"), ("op", "op"),
])
def test_bad_input_refused_at_the_call(errors_job, case, needle):
    size, outs = errors_job
    # Unsupported dtypes raise UnsupportedDtypeError, an InvalidArgumentError subclass.
    expected = "UnsupportedDtypeError" if case.startswith("dtype.") else "InvalidArgumentError"
    for rank, got in _every_rank(outs, f"refused.{case}"):
        assert got["type"] == expected, f"rank {rank}: {got}"
        assert needle in got["message"] and f"refused.{case}" in got["message"], got
    for rank, got in _every_rank(outs, "after.refusals"):
        assert got["ok"], f"rank {rank}: {got}"


def test_use_before_init_and_after_shutdown(errors_job):
    size, outs = errors_job
    for rank, out in sorted(outs.items()):
        for case in ("before_init_allreduce", "before_init_rank", "after_shutdown_allreduce",
                     "after_shutdown_async", "after_shutdown_rank"):
            assert out[case]["type"] == "NotInitializedError", f"rank {rank} {case}: {out[case]}"
            assert "init" in out[case]["message"], out[case]
        assert out["shutdown_again"]["type"] is None, "shutdown must be idempotent"
        assert out["is_initialized_after"] is False


def test_shutdown_by_one_rank_ends_pending_ops_everywhere(errors_job):
    size, outs = errors_job
    for rank, got in _every_rank(outs, "pending_at_shutdown"):
        assert got["type"] == "ShutdownError", f"rank {rank}: {got}"
        assert "shut down" in got["message"], got
    assert outs[0]["shutdown_s"] < 10
    for rank in range(1, size):
        # Released by rank 0's shutdown (0.5 s in), not by the 30 s wait timeout.
        assert outs[rank]["waited_s"] < 10, outs[rank]
        late = outs[rank]["enqueue_after_remote_shutdown"]
        assert late["type"] in ("ShutdownError", "NotInitializedError"), late
