"""Bad arguments in a real multi-rank job: each is refused at the call with a clear
message, and the job is unaffected (every rank makes the same bad calls, then the same
good ones, whose results are checked; the core counted no failed op)."""
import subprocess
import sys
import textwrap

import pytest

import harness
from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

NP = 2

SCRIPT = r'''
import json, logging, os, sys
import numpy as np
import hvdlite as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
E = hvd.errors
refused = {}

def refuse(label, fn, cls=E.InvalidArgumentError, *words):
    try:
        fn()
    except cls as e:
        text = str(e)
        missing = [w for w in words if w not in text]
        refused[label] = "ok" if not missing else f"message lacks {missing}: {text}"
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        refused[label] = f"wrong exception {type(e).__name__}: {e}"
    else:
        refused[label] = "not refused"

x = np.arange(6, dtype=np.float32)
refuse("complex", lambda: hvd.allreduce(np.ones(3, np.complex64), name="c"), E.InvalidArgumentError, "complex64")
refuse("object", lambda: hvd.allreduce(np.array([1, "a"], dtype=object), name="o"), E.InvalidArgumentError, "object")
refuse("unicode", lambda: hvd.allreduce(np.array(["ab", "c"]), name="u"), E.InvalidArgumentError, "'u'")
refuse("bytes", lambda: hvd.allgather(np.array([b"ab"]), name="b"), E.InvalidArgumentError, "'b'")
refuse("noncontiguous", lambda: hvd.allreduce(np.ones((4, 4), np.float32)[:, 1], name="nc"), E.InvalidArgumentError, "C-contiguous")
refuse("negative_root", lambda: hvd.broadcast(x, -1, name="nr"), E.InvalidArgumentError, "-1", "out of range")
refuse("big_root", lambda: hvd.broadcast(x, n, name="br"), E.InvalidArgumentError, str(n), "out of range")
refuse("splits_sum", lambda: hvd.alltoall(x, splits=[1] * n, name="ss"), E.InvalidArgumentError, "sum")
refuse("splits_negative", lambda: hvd.alltoall(x, splits=[7] + [-1] * (n - 1), name="sn"), E.InvalidArgumentError, "negative")
refuse("splits_count", lambda: hvd.alltoall(x, splits=[6], name="sc"), E.InvalidArgumentError, "entries")
refuse("scalar_allgather", lambda: hvd.allgather(np.float32(1), name="sa"), E.InvalidArgumentError, "dimension")
refuse("nul_name", lambda: hvd.allreduce(x, name="a\0b"), E.InvalidArgumentError, "NUL")
refuse("empty_name", lambda: hvd.allreduce(x, name=""), E.InvalidArgumentError, "non-empty")
too_long = "n" * (2 << 20)
refuse("huge_name", lambda: hvd.allreduce(x, name=too_long), E.InvalidArgumentError, "too long")
# Read-only input: collectives only read their input, so it is accepted and untouched.
ro = np.arange(4, dtype=np.float32)
ro.setflags(write=False)
ro_ok = (hvd.allreduce(ro, name="readonly", op=hvd.Sum) == ro * n).all() and not ro.flags.writeable
# A name in flight: the second submission is refused, the first completes. Each rank in
# turn repeats the name before the barrier, ahead of its peers (so it is surely in flight).
dup_ok = True
for first in range(n):
    if r == first:
        h = hvd.allreduce_async(np.ones(3, np.float32), name=f"dup{first}", op=hvd.Sum)
        refuse("duplicate", lambda: hvd.allreduce_async(np.ones(3, np.float32), name=f"dup{first}"), E.DuplicateNameError, f"dup{first}")
        hvd.barrier()
    else:
        hvd.barrier()
        h = hvd.allreduce_async(np.ones(3, np.float32), name=f"dup{first}", op=hvd.Sum)
    dup_ok = dup_ok and (hvd.synchronize(h) == n).all()
# init() twice: a warning, no effect.
hvd.init()
twice_ok = hvd.rank() == r and hvd.size() == n and hvd.is_initialized()
# A timeline file that cannot be written raises at the call (rank 0 writes it).
try:
    hvd.start_timeline("/nonexistent-dir/sub/timeline.json")
    timeline = "not refused" if r == 0 else "ok"
except E.HvdliteError as e:
    timeline = "ok" if r == 0 and "/nonexistent-dir/sub/timeline.json" in str(e) else repr(e)

# Good calls that look odd: all must work.
good = {}
long_name = "long-" + "x" * 60_000
good["long_name"] = bool((hvd.allreduce(np.ones(2, np.float32), name=long_name, op=hvd.Sum) == n).all())
good["unicode_name"] = bool((hvd.allreduce(np.ones(2, np.float32), name="gradient/вес/重み/🙂", op=hvd.Sum) == n).all())
good["zero_size"] = hvd.allreduce(np.ones((0, 3), np.float32), name="z").shape == (0, 3)
good["zero_gather"] = hvd.allgather(np.ones((0, 2), np.int32), name="zg").shape == (0, 2)
good["zero_d"] = float(hvd.allreduce(np.float64(r), name="s", op=hvd.Sum)) == n * (n - 1) / 2
good["zero_d_bcast"] = float(hvd.broadcast(np.float32(r + 5), n - 1, name="sb")) == n - 1 + 5
big = np.full(1 << 18, r, np.float32)  # 1 MiB, above the fusion threshold of this job
hs = [hvd.allreduce_async(big, name="big", op=hvd.Sum)] + [
    hvd.allreduce_async(np.full(10, r, np.float32), name=f"small{i}", op=hvd.Sum) for i in range(5)]
outs = [hvd.synchronize(h) for h in hs]
good["over_threshold"] = all((o == n * (n - 1) / 2).all() for o in outs)
# The names of refused calls were never enqueued: they can be used now.
good["names_free"] = bool((hvd.allreduce(np.ones(2, np.float32), name="nc", op=hvd.Sum) == n).all())
stats = hvd.stats()
print("HVDLITE_RESULT", json.dumps({"refused": refused, "good": good, "ro": bool(ro_ok),
                                    "dup": bool(dup_ok), "twice": bool(twice_ok),
                                    "timeline": timeline, "errors": stats["errors"]}))
hvd.shutdown()
'''


def test_bad_arguments_are_refused_without_effect():
    result = assert_ok(run_job(NP, SCRIPT, timeout=240,
                               env={"HVDLITE_FUSION_THRESHOLD": str(64 * 1024)}))
    problems = []
    for r in range(NP):
        out = result.result(r)
        problems += [f"rank {r}: {k}: {v}" for k, v in out["refused"].items() if v != "ok"]
        problems += [f"rank {r}: {k} failed" for k, v in out["good"].items() if v is not True]
        for key in ("ro", "dup", "twice"):
            if out[key] is not True:
                problems.append(f"rank {r}: {key} failed")
        if out["timeline"] != "ok":
            problems.append(f"rank {r}: timeline: {out['timeline']}")
        if out["errors"] != 0:
            problems.append(f"rank {r}: the core counted {out['errors']} failed ops")
    assert not problems, "\n".join(problems) + "\n" + describe(result)
    assert any("already initialized" in line for line in result.rank_stderr.get(0, [])), \
        describe(result)


def _single(code):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=harness.job_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_calls_before_init_and_after_shutdown_raise():
    _single('''
        import numpy as np
        import hvdlite as hvd
        calls = {
            "rank": hvd.rank, "size": hvd.size,
            "allreduce": lambda: hvd.allreduce(np.ones(2, np.float32), name="a"),
            "allgather": lambda: hvd.allgather(np.ones(2, np.float32), name="g"),
            "broadcast": lambda: hvd.broadcast(np.ones(2, np.float32), 0, name="b"),
            "barrier": hvd.barrier,
            "start_timeline": lambda: hvd.start_timeline("/tmp/x.json"),
        }
        def check(when):
            for label, fn in calls.items():
                try:
                    fn()
                except hvd.errors.NotInitializedError as e:
                    assert "init" in str(e), (when, label, str(e))
                else:
                    raise AssertionError(f"{label} did not raise {when}")
        check("before init")
        hvd.init()
        assert (hvd.allreduce(np.ones(2, np.float32), name="a") == 1).all()
        hvd.shutdown()
        check("after shutdown")
        hvd.shutdown()  # idempotent
    ''')
