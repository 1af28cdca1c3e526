"""Property-based checks of the wire format and the coordinator's decisions (hypothesis).

The core is driven through testing.h in this process, with no MPI: parsing happens on a
copy of the message that ends right before an inaccessible page, so a read past its end
would crash this test instead of passing unnoticed.
"""
import math
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import wire

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

OPS = {"allreduce": 0, "allgather": 1, "broadcast": 2, "alltoall": 3, "reducescatter": 4,
       "barrier": 5}
NUM_DTYPES, NUM_OPS, NUM_REDUCE_OPS = 11, 7, 5
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def core():
    from hvdlite._native import ffi, lib
    # setup.py always builds the testing entry points in: their absence is a failure.
    assert hasattr(lib, "hvdlite_test_roundtrip_requests"), "library built without testing.h"
    return ffi, lib


def _call_out(core, fn, *args):
    """Calls fn(*args, out, cap, out_len[, ...]) growing the buffer as needed."""
    ffi, lib = core
    cap = 1 << 12
    while True:
        out = ffi.new("uint8_t[]", cap)
        out_len = ffi.new("int64_t *")
        status = fn(*args, out, cap, out_len)
        if status == lib.HVDLITE_ERR_INVALID_ARGUMENT and out_len[0] > cap:
            cap = out_len[0]
            continue
        message = ffi.string(lib.hvdlite_last_error()).decode() if status else ""
        return status, bytes(ffi.buffer(out, out_len[0])) if status == 0 else b"", message


def roundtrip(core, kind, data):
    ffi, lib = core
    fn = getattr(lib, f"hvdlite_test_roundtrip_{kind}")
    count = ffi.new("int32_t *")
    status, out, message = _call_out(
        core, lambda *a: fn(data, len(data), *a, count))
    return status, out, count[0], message


# -- strategies -----------------------------------------------------------------------

names = st.text(min_size=0, max_size=40)
i32 = st.integers(-2**31, 2**31 - 1)
i64 = st.integers(-2**63, 2**63 - 1)
f64 = st.floats(allow_nan=False)
small_ints = st.lists(i64, max_size=6)

requests = st.builds(
    wire.Request, rank=i32, name=names, op=st.integers(0, NUM_OPS - 1),
    dtype=st.integers(0, NUM_DTYPES - 1), shape=small_ints, reduce_op=i32, prescale=f64,
    postscale=f64, root_rank=i32, splits=small_ints, process_set=i32, device=i32,
    group=names, group_size=i32, wait_ms=i64, refusal=names)

responses = st.builds(
    wire.Response, op=st.integers(0, NUM_OPS - 1), name=names, error=names, error_code=i32,
    dtype=st.integers(0, NUM_DTYPES - 1), on_device=st.booleans(), shape=small_ints,
    reduce_op=i32, prescale=f64, postscale=f64, root_rank=i32, contributors=i32,
    last_joined_rank=i32,
    cacheable=st.booleans(), group=names, first_dims=small_ints, splits=small_ints,
    joined=st.binary(max_size=8), targets=st.binary(max_size=8))

KINDS = [("requests", requests, wire.encode_requests),
         ("responses", responses, wire.encode_responses)]


# -- the wire format --------------------------------------------------------------------

@pytest.mark.parametrize("kind,strategy,encode", KINDS, ids=[k[0] for k in KINDS])
def test_round_trip_is_exact(core, kind, strategy, encode):
    @SETTINGS
    @given(st.lists(strategy, max_size=5))
    def check(items):
        data = encode(items)
        status, out, count, message = roundtrip(core, kind, data)
        assert status == 0, message
        assert count == len(items)
        assert out == data

    check()


@pytest.mark.parametrize("kind,strategy,encode", KINDS, ids=[k[0] for k in KINDS])
def test_truncated_messages_are_rejected(core, kind, strategy, encode):
    ffi, lib = core

    @SETTINGS
    @given(st.lists(strategy, min_size=1, max_size=4), st.data())
    def check(items, data):
        full = encode(items)
        cut = data.draw(st.integers(0, len(full) - 1), label="cut")
        status, _, _, message = roundtrip(core, kind, full[:cut])
        assert status == lib.HVDLITE_ERR_INTERNAL, (cut, len(full))
        assert "corrupted or truncated" in message
        # Trailing bytes after a whole message are corruption too.
        extra = data.draw(st.binary(min_size=1, max_size=16), label="extra")
        status, _, _, message = roundtrip(core, kind, full + extra)
        assert status == lib.HVDLITE_ERR_INTERNAL
        assert "corrupted or truncated" in message

    check()


@pytest.mark.parametrize("kind,strategy,encode", KINDS, ids=[k[0] for k in KINDS])
def test_corrupted_messages_never_crash(core, kind, strategy, encode):
    """Flipped bytes: either an error, or a message that round-trips to itself."""
    ffi, lib = core

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(strategy, min_size=1, max_size=3), st.data())
    def check(items, data):
        raw = bytearray(encode(items))
        flips = data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1),
                                             st.integers(0, 255)), min_size=1, max_size=4))
        for pos, value in flips:
            raw[pos] = value
        status, out, _, message = roundtrip(core, kind, bytes(raw))
        if status != 0:
            assert status == lib.HVDLITE_ERR_INTERNAL, message
            assert "message" in message
        else:
            again = roundtrip(core, kind, out)
            assert again[0] == 0 and again[1] == out

    check()


@pytest.mark.parametrize("kind", ["requests", "responses"])
def test_random_bytes_and_huge_lengths(core, kind):
    ffi, lib = core

    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=200))
    def check(blob):
        status, _, _, _ = roundtrip(core, kind, blob)
        assert status in (0, lib.HVDLITE_ERR_INTERNAL)

    check()
    # A count or length field near 2**32 must be refused, not allocated or read.
    header = bytes([wire.WIRE_VERSION]) + (1).to_bytes(4, "little")
    for tail in [(0xFFFFFFFF).to_bytes(4, "little"),
                 (0).to_bytes(4, "little") + (0xFFFFFFF0).to_bytes(4, "little")]:
        status, _, _, message = roundtrip(core, kind, header + tail)
        assert status == lib.HVDLITE_ERR_INTERNAL, message
    for count in (0xFFFFFFFF, 1 << 24):
        blob = bytes([wire.WIRE_VERSION]) + count.to_bytes(4, "little")
        assert roundtrip(core, kind, blob)[0] == lib.HVDLITE_ERR_INTERNAL
    status, _, _, message = roundtrip(core, kind, bytes([wire.WIRE_VERSION + 1, 0, 0, 0, 0]))
    assert status == lib.HVDLITE_ERR_INTERNAL and "wire version" in message
    assert roundtrip(core, kind, b"")[0] == lib.HVDLITE_ERR_INTERNAL


# -- the coordinator ----------------------------------------------------------------------

class Sim:
    """One simulated coordinator (rank 0's Controller) for `size` ranks."""

    def __init__(self, core, size, stall_check=0.0, stall_shutdown=0.0):
        self.ffi, self.lib = core
        self.core = core
        out = self.ffi.new("int64_t *")
        assert self.lib.hvdlite_test_controller_new(size, stall_check, stall_shutdown, out) == 0
        self.id = out[0]

    def add(self, requests, now):
        data = wire.encode_requests(requests)
        assert self.lib.hvdlite_test_controller_add(self.id, data, len(data), now) == 0

    def build(self, now):
        status, out, message = _call_out(
            self.core, lambda *a: self.lib.hvdlite_test_controller_build(self.id, now, *a))
        assert status == 0, message
        return wire.decode_responses(out)

    def pending(self):
        out = self.ffi.new("int64_t *")
        assert self.lib.hvdlite_test_controller_pending(self.id, out) == 0
        return out[0]

    def close(self):
        self.lib.hvdlite_test_controller_free(self.id)


# Properties that each op checks across ranks, with a value that differs from the base.
MISMATCHABLE = {
    "allreduce": ["op", "dtype", "shape", "reduce_op", "prescale", "device", "process_set"],
    "allgather": ["op", "dtype", "trailing", "device", "process_set"],
    "broadcast": ["op", "dtype", "shape", "root_rank", "device", "process_set"],
    "alltoall": ["op", "dtype", "trailing", "device", "process_set"],
    "reducescatter": ["op", "dtype", "shape", "reduce_op", "postscale", "process_set"],
    "barrier": ["op", "process_set"],
}
EXPECTED_WORDS = {"op": "operations", "dtype": "data types", "shape": "shapes",
                  "trailing": "trailing dimensions", "reduce_op": "reduction ops",
                  "prescale": "scale factors", "postscale": "scale factors",
                  "root_rank": "root ranks", "device": "devices",
                  "process_set": "process sets"}


@st.composite
def scenarios(draw):
    """Tensors submitted by every simulated rank, some with one rank disagreeing."""
    size = draw(st.integers(2, 5), label="size")
    count = draw(st.integers(1, 8), label="tensors")
    tensors = []
    for t in range(count):
        op_name = draw(st.sampled_from(sorted(MISMATCHABLE)))
        op = OPS[op_name]
        ndim = draw(st.integers(1, 3))
        shape = draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim))
        base = wire.Request(name=f"t{t}", op=op, dtype=draw(st.integers(0, 7)),
                            shape=shape, reduce_op=draw(st.integers(0, 4)),
                            root_rank=draw(st.integers(0, size - 1)))
        per_rank = []
        for r in range(size):
            q = wire.Request(**{**base.__dict__, "shape": list(shape), "rank": r})
            if op_name in ("allgather", "alltoall"):
                q.shape[0] = draw(st.integers(0, 6))  # first dims may differ
            if op_name == "alltoall":
                cuts = sorted(draw(st.lists(st.integers(0, q.shape[0]), min_size=size - 1,
                                            max_size=size - 1)))
                q.splits = [b - a for a, b in zip([0] + cuts, cuts + [q.shape[0]])]
            per_rank.append(q)
        mismatch = None
        if draw(st.booleans()):
            prop = draw(st.sampled_from(MISMATCHABLE[op_name]))
            victim = draw(st.integers(0, size - 1))
            q = per_rank[victim]
            if prop == "op":
                q.op = (q.op + 1) % 6
            elif prop == "dtype":
                q.dtype = (q.dtype + 1) % 8
            elif prop == "shape":
                q.shape = q.shape + [2]
            elif prop == "trailing":
                q.shape = q.shape + [3]
            elif prop == "reduce_op":
                q.reduce_op = (q.reduce_op + 1) % 5
            elif prop == "prescale":
                q.prescale = 0.5
            elif prop == "postscale":
                q.postscale = 2.0
            elif prop == "root_rank":
                q.root_rank = (q.root_rank + 1) % size
            elif prop == "device":
                q.device = 0
            elif prop == "process_set":
                q.process_set = 1
            mismatch = (prop, victim)
        tensors.append((base, per_rank, mismatch))
    # Every (rank, tensor) request, in a random arrival order, cut into random rounds.
    arrivals = [(r, t) for t in range(count) for r in range(size)]
    arrivals = draw(st.permutations(arrivals), label="arrival order")
    cuts = sorted(set(draw(st.lists(st.integers(1, len(arrivals)), max_size=6))))
    rounds, start = [], 0
    for cut in cuts + [len(arrivals)]:
        if cut > start:
            rounds.append(arrivals[start:cut])
            start = cut
    return size, tensors, rounds


def check_response(resp, base, per_rank, mismatch, size):
    if mismatch:
        prop, victim = mismatch
        assert resp.error_code != 0, (prop, resp)
        assert f"tensor '{base.name}'" in resp.error
        assert EXPECTED_WORDS[prop] in resp.error, (prop, resp.error)
        assert f"rank {victim}" in resp.error or "ranks" in resp.error
        assert not resp.cacheable
        return
    assert resp.error_code == 0 and resp.error == "", resp.error
    assert resp.op == base.op and resp.dtype == base.dtype
    assert resp.contributors == size
    if base.op in (OPS["allreduce"], OPS["broadcast"], OPS["reducescatter"]):
        assert resp.shape == base.shape
    if base.op in (OPS["allreduce"], OPS["reducescatter"]):
        assert resp.reduce_op == base.reduce_op
    if base.op == OPS["broadcast"]:
        assert resp.root_rank == base.root_rank
    if base.op == OPS["allgather"]:
        assert resp.first_dims == [q.shape[0] for q in per_rank]
    if base.op == OPS["alltoall"]:
        assert resp.splits == [s for q in per_rank for s in q.splits]
    assert resp.cacheable  # every op of one tensor, the barrier too (no rank joined here)


def test_coordinator_random_arrival_orders(core):
    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(scenarios())
    def check(scenario):
        size, tensors, rounds = scenario
        sim = Sim(core, size)
        try:
            seen = {}
            submitted = {t: set() for t in range(len(tensors))}
            now = 0.0
            for batch in rounds:
                now += 0.001
                sim.add([tensors[t][1][r] for r, t in batch], now)
                for r, t in batch:
                    submitted[t].add(r)
                for resp in sim.build(now):
                    t = int(resp.name[1:])
                    assert resp.name not in seen, f"{resp.name} answered twice"
                    # Never before every rank has submitted it.
                    assert len(submitted[t]) == size, (resp.name, submitted[t])
                    seen[resp.name] = resp
            assert sorted(seen) == sorted(f"t{t}" for t in range(len(tensors)))
            assert sim.pending() == 0
            for t, (base, per_rank, mismatch) in enumerate(tensors):
                check_response(seen[f"t{t}"], base, per_rank, mismatch, size)
        finally:
            sim.close()

    check()


def test_coordinator_stalls_name_the_missing_ranks(core):
    @settings(max_examples=100, deadline=None)
    @given(st.integers(2, 5), st.data())
    def check(size, data):
        sim = Sim(core, size, stall_check=1.0, stall_shutdown=2.0)
        try:
            present = data.draw(st.sets(st.integers(0, size - 1), min_size=1,
                                        max_size=size - 1), label="present")
            sim.add([wire.Request(rank=r, name="stuck", shape=[3]) for r in present], 0.0)
            sim.add([wire.Request(rank=r, name="fine", shape=[3]) for r in range(size)], 0.0)
            first = sim.build(0.0)
            assert [p.name for p in first] == ["fine"]
            assert sim.build(1.5) == []  # warned (stderr), not failed yet
            late = sim.build(2.5)
            assert [p.name for p in late] == ["stuck"]
            missing = sorted(set(range(size)) - present)
            err = late[0].error
            assert late[0].error_code != 0
            assert "stalled" in err and "'stuck'" in err and "HVDLITE_STALL_SHUTDOWN_TIME" in err
            label = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
            assert label in err, err
            assert sim.pending() == 0
        finally:
            sim.close()

    check()


def test_coordinator_groups_are_all_or_nothing(core):
    @settings(max_examples=100, deadline=None)
    @given(st.integers(2, 4), st.integers(2, 5), st.data())
    def check(size, members, data):
        sim = Sim(core, size)
        try:
            bad = data.draw(st.one_of(st.none(), st.integers(0, members - 1)), label="bad")
            reqs = []
            for m in range(members):
                for r in range(size):
                    shape = [4] if not (m == bad and r == size - 1) else [5]
                    reqs.append(wire.Request(rank=r, name=f"g.{m}", shape=shape, group="g",
                                             group_size=members))
            order = data.draw(st.permutations(reqs), label="order")
            answered = []
            for i, q in enumerate(order):
                sim.add([q], i * 0.001)
                out = sim.build(i * 0.001)
                if i < len(order) - 1:
                    assert out == [], "a group member left before the group was complete"
                else:
                    answered = out
            assert sorted(p.name for p in answered) == [f"g.{m}" for m in range(members)]
            if bad is None:
                assert all(p.error == "" for p in answered)
            else:
                assert all("Mismatched shapes" in p.error for p in answered)
        finally:
            sim.close()

    check()


def test_an_entry_removed_before_its_cycle_leaves_the_pending_list(core):
    # The background thread reads the pending entries in place; one that a response
    # removed before a cycle took it must not be handed to that cycle (it would be
    # freed memory).
    ffi, lib = core
    pending_after = ffi.new("int64_t *", -1)
    assert lib.hvdlite_test_queue_remove_pending(pending_after) == lib.HVDLITE_OK
    assert pending_after[0] == 0
