"""Timeline: real 2-rank runs with the timeline on, the file it writes, and the summary tool;
and the recorder's ring alone (testing.h, in this process), wrapping and overflowing.

Every figure the summary prints is recomputed here from the raw events, independently of
hvdlite.timeline_summary (which only the subprocess running ``python -m hvdlite`` uses).
"""
import json
import os
import subprocess
import sys

import pytest

import needs

from harness import assert_ok, job_env, run_job

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("native")]

NP = 2
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False
try:
    import matplotlib  # noqa: F401
    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False

# A few steps of training; reports the names of the tensors it allreduced.
TORCH_TRAINING = """
    import json
    import torch
    import hvdlite.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(6):
        x = torch.randn(8, 16) + hvd.rank()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    names = ["allreduce." + n for n, _ in model.named_parameters()]
    print("HVDLITE_RESULT", json.dumps({"allreduced": names}))
    hvd.shutdown()
"""
NUMPY_TRAINING = """
    import json, time
    import numpy as np
    import hvdlite as hvd
    hvd.init()
    names = [f"grad.{i}" for i in range(6)]
    for step in range(6):
        handles = []
        for i, name in enumerate(reversed(names)):  # backprop: last layer first
            time.sleep(0.001)
            handles.append(hvd.allreduce_async(np.full(64 * (i + 1), hvd.rank(), np.float32),
                                               name=name))
        for h in handles:
            hvd.synchronize(h)
    print("HVDLITE_RESULT", json.dumps({"allreduced": names}))
    hvd.shutdown()
"""


def read_trace(path):
    with open(path) as f:
        return json.load(f)


def track_names(events):
    return {e["tid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}


def spans_by_track(events):
    """tid -> list of spans (dicts: name, start, end, depth, args, children, marks), checking
    that every B has its E on its own track; a complete (X) event is a span nested in the
    one open on its track."""
    stacks, out = {}, {}
    for e in events:
        if e.get("ph") not in ("B", "E", "X", "i"):
            continue
        tid = e["tid"]
        stack = stacks.setdefault(tid, [])
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
            span = {"name": e["name"], "start": e["ts"], "end": e["ts"] + e["dur"],
                    "depth": len(stack), "args": e.get("args", {}), "children": [],
                    "marks": []}
            (stack[-1]["children"] if stack else out.setdefault(tid, [])).append(span)
        elif e["ph"] == "B":
            span = {"name": e["name"], "start": e["ts"], "end": None, "depth": len(stack),
                    "args": e.get("args", {}), "children": [], "marks": []}
            (stack[-1]["children"] if stack else out.setdefault(tid, [])).append(span)
            stack.append(span)
        elif e["ph"] == "E":
            assert stack, f"an E without its B on track {tid}: {e}"
            stack.pop()["end"] = e["ts"]
        elif stack:
            stack[0]["marks"].append(e)
    for tid, stack in stacks.items():
        assert not stack, f"spans left open on track {tid}: {[s['name'] for s in stack]}"
    return out


def union_length(intervals, until=None):
    total, cur = 0.0, None
    for a, b in sorted(intervals):
        if until is not None:
            b = min(b, until)
            if b <= a:
                continue
        if cur is None or a > cur[1]:
            if cur:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return total + (cur[1] - cur[0] if cur else 0.0)


def summary_of(path, *extra):
    """Runs ``python -m hvdlite timeline summary`` (the hvdlite command) and returns
    (completed process, parsed JSON)."""
    proc = subprocess.run([sys.executable, "-m", "hvdlite", "timeline", "summary", str(path),
                           "--json", *extra], capture_output=True, text=True, timeout=120,
                          env=job_env())
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(proc.stdout)


# The activities inside an ALLREDUCE span, by the path the allreduce took.
ALLREDUCE_ACTIVITIES = {  # the phases an allreduce may show, by path
    # every rank on this machine: through shared memory, packing and scaling on the way;
    # or, a small cached tensor that was its rank's only request in its cycle (which
    # depends on timing), carried by the coordination round (HVDLITE_CARRY_DATA)
    "shm": [["QUEUE", "SHM_ALLREDUCE"], ["QUEUE", "CARRIED_ALLREDUCE"]],
    # HVDLITE_SHM_ALLREDUCE=0: MPI on the fusion buffer (or on the tensor itself)
    "mpi": [["QUEUE", "MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"]],
}


@pytest.fixture(scope="module", params=sorted(ALLREDUCE_ACTIVITIES))
def training_trace(request, tmp_path_factory):
    """A 2-rank training run with ``hvdliterun --timeline-filename``; returns the file,
    the names of the allreduced tensors and the allreduce path ("shm" or "mpi")."""
    path = tmp_path_factory.mktemp("timeline") / "timeline.json"
    script = TORCH_TRAINING if HAVE_TORCH else NUMPY_TRAINING
    env = {"HVDLITE_SHM_ALLREDUCE": "1" if request.param == "shm" else "0"}
    result = assert_ok(run_job(NP, script, timeout=180, env=env,
                               launcher_args=["--timeline-filename", str(path)]))
    return path, result.result(0)["allreduced"], request.param


def test_trace_is_json_with_a_track_per_allreduced_tensor(training_trace):
    path, allreduced, transport = training_trace
    events = read_trace(path)  # a normal shutdown leaves valid JSON
    assert isinstance(events, list) and events
    names = set(track_names(events).values())
    missing = [n for n in allreduced if n not in names]
    assert not missing, f"no track for {missing}; tracks: {sorted(names)}"


def test_phases_in_order_nested_and_timed(training_trace):
    path, allreduced, transport = training_trace
    events = read_trace(path)
    per_track = {}
    for e in events:
        if "ts" in e:
            per_track.setdefault(e.get("tid"), []).append(e["ts"])
    for tid, timed in per_track.items():
        assert timed == sorted(timed), f"timestamps go backwards on track {tid}"
    names = track_names(events)
    by_track = spans_by_track(events)
    tid_of = {name: tid for tid, name in names.items()}
    cached_marks = 0
    for name in allreduced:
        spans = by_track[tid_of[name]]
        kinds = [s["name"] for s in spans]
        # Per step: the negotiation, then the operation.
        assert kinds == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"] * (len(kinds) // 2), kinds
        assert len(kinds) // 2 >= 6, f"{name}: {len(kinds) // 2} steps recorded, expected 6"
        for negotiate, op in zip(spans[::2], spans[1::2]):
            assert negotiate["start"] <= negotiate["end"] <= op["start"] <= op["end"]
            ready = [m["name"] for m in negotiate["marks"]]
            assert any(m.endswith(" ready") for m in ready), f"{name}: no readiness mark"
            cached_marks += "all ranks ready" in ready
            for m in negotiate["marks"]:
                assert negotiate["start"] <= m["ts"] <= negotiate["end"]
            children = [c["name"] for c in op["children"]]
            assert children in ALLREDUCE_ACTIVITIES[transport], children
            t = op["start"]
            for c in op["children"]:
                assert t <= c["start"] <= c["end"] <= op["end"], (name, c)
                assert not c["children"]
                t = c["end"]
            args = op["args"]
            assert args["dtype"] == "float32"
            shape = json.loads(args["shape"])
            count = 1
            for d in shape:
                count *= d
            assert args["bytes"] == 4 * count
            assert args["fused"] >= 1
    # After the first step the response cache answers; rank 0 then marks the one thing
    # it can see, that every rank is ready.
    assert cached_marks > 0


def expected_summary(events):
    """The summary's figures, computed from the raw events as the module docstring of
    hvdlite.timeline_summary defines them."""
    by_track = spans_by_track(events)
    flat = []

    def walk(spans, tid):
        for s in spans:
            flat.append((tid, s))
            walk(s["children"], tid)
    for tid, spans in by_track.items():
        walk(spans, tid)
    activities = {}
    for _, s in flat:
        a = activities.setdefault(s["name"], {"count": 0, "total": 0.0, "intervals": []})
        a["count"] += 1
        a["total"] += s["end"] - s["start"]
        a["intervals"].append((s["start"], s["end"]))
    waits, bytes_ = {}, {}
    names = track_names(events)
    for tid, spans in by_track.items():
        for s in spans:
            if s["name"].startswith("NEGOTIATE_"):
                t = [m["ts"] for m in s["marks"] if m["name"].endswith(" ready")]
                if t:
                    waits.setdefault(names[tid], []).append(max(t) - min(t))
            else:
                bytes_[names[tid]] = bytes_.get(names[tid], 0) + s["args"].get("bytes", 0)
    # Steps: negotiations in start order; a new one when a track comes back.
    negotiations = sorted(((s["start"], tid, s) for tid, spans in by_track.items()
                           for s in spans if s["name"].startswith("NEGOTIATE_")),
                          key=lambda x: x[0])
    step, seen, backprop_end = 0, set(), {}
    for start, tid, s in negotiations:
        if tid in seen:
            step, seen = step + 1, set()
        seen.add(tid)
        s["step"] = step
        backprop_end[step] = start
    comm = {}
    for tid, spans in by_track.items():
        current = None
        for s in spans:
            if s["name"].startswith("NEGOTIATE_"):
                current = s["step"]
                continue
            for c in s["children"]:
                if c["name"].startswith(("MPI_", "SHM_", "NCCL_")):
                    comm.setdefault(current, []).append((c["start"], c["end"]))
    wall = sum(union_length(v) for v in comm.values())
    overlapped = sum(union_length(v, until=backprop_end[k]) for k, v in comm.items())
    return {"activities": activities, "waits": waits, "bytes": bytes_, "steps": step + 1,
            "comm_wall": wall, "overlapped": overlapped}


def test_summary_agrees_with_the_file(training_trace):
    # Without --plot: no matplotlib, so this also runs under the sanitizers' preloaded
    # runtime (see README), where drawing cannot.
    path, allreduced, transport = training_trace
    _, summary = summary_of(path)
    want = expected_summary(read_trace(path))
    got = {a["name"]: a for a in summary["activities"]}
    assert set(got) == set(want["activities"])
    for name, a in want["activities"].items():
        assert got[name]["count"] == a["count"], name
        assert got[name]["total_ms"] == pytest.approx(a["total"] / 1e3, abs=1e-6), name
        assert got[name]["mean_ms"] == pytest.approx(a["total"] / a["count"] / 1e3, abs=1e-6)
        assert got[name]["wall_ms"] == pytest.approx(union_length(a["intervals"]) / 1e3,
                                                     abs=1e-6)
    tensors = {t["name"]: t for t in summary["tensors"]}
    for name in allreduced:
        waits = want["waits"][name]
        assert tensors[name]["wait_max_ms"] == pytest.approx(max(waits) / 1e3, abs=1e-6)
        assert tensors[name]["wait_mean_ms"] == pytest.approx(
            sum(waits) / len(waits) / 1e3, abs=1e-6)
        assert tensors[name]["bytes"] == want["bytes"][name]
    assert summary["bytes_total"] == sum(want["bytes"].values())
    assert summary["steps"] == want["steps"]
    comm = summary["communication"]
    assert comm["wall_ms"] == pytest.approx(want["comm_wall"] / 1e3, abs=1e-6)
    assert comm["overlapped_ms"] == pytest.approx(want["overlapped"] / 1e3, abs=1e-6)
    assert 0.0 <= comm["overlap_share"] <= 1.0
    assert summary["unfinished_spans"] == 0 and summary["problems"] == []
    # And the table form prints every activity.
    table = subprocess.run([sys.executable, "-m", "hvdlite", "timeline", "summary", str(path)],
                           capture_output=True, text=True, timeout=120, env=job_env())
    assert table.returncode == 0, table.stderr
    for name in want["activities"]:
        assert name in table.stdout
    assert "overlapped backprop" in table.stdout


@needs.needs("matplotlib", HAVE_MATPLOTLIB, "matplotlib is not installed")
def test_summary_draws_a_png(training_trace, tmp_path):
    path, _, _ = training_trace
    png = tmp_path / "timeline.png"
    _, summary = summary_of(path, "--plot", str(png))
    assert summary["activities"] and summary["problems"] == []
    data = png.read_bytes()
    assert len(data) > 0 and data.startswith(PNG_SIGNATURE)


def test_start_stop_at_run_time_records_only_in_between(tmp_path):
    path = tmp_path / "runtime.json"
    script = """
        import json, sys, time
        import numpy as np
        import hvdlite as hvd
        path = sys.argv[1]
        hvd.init()
        x = np.ones(256, np.float32)
        def step(prefix, n=3):
            for i in range(n):
                hvd.allreduce(x, name=f"{prefix}.{i}")
        step("before")
        hvd.start_timeline(path, mark_cycles=True)
        # Started while rank 0's request is already in flight: rank 1 comes late.
        if hvd.rank() == 1:
            time.sleep(0.3)
        step("during")
        # Stopped in the middle of a negotiation: rank 1 comes late again.
        h = hvd.allreduce_async(x, name="cut")
        if hvd.rank() == 0:
            time.sleep(0.1)
            hvd.stop_timeline()
        else:
            time.sleep(0.4)
        hvd.synchronize(h)
        step("after")
        print("HVDLITE_RESULT", json.dumps({"ok": True}))
        hvd.shutdown()
    """
    assert_ok(run_job(NP, script, args=[path], timeout=120))
    events = read_trace(path)  # valid JSON right after stop_timeline
    names = set(track_names(events).values())
    assert {"during.0", "during.1", "during.2"} <= names
    assert not {n for n in names if n.startswith(("before.", "after."))}, names
    spans_by_track(events)  # balanced although it started and stopped mid-flight
    assert any(e.get("name") == "CYCLE_START" for e in events)


def test_negotiation_balanced_when_rank_0_has_joined(tmp_path):
    path = tmp_path / "join.json"
    script = """
        import json
        import numpy as np
        import hvdlite as hvd
        hvd.init()
        x = np.ones(32, np.float32)
        steps = 2 if hvd.rank() == 0 else 4  # rank 0 joins early
        for i in range(steps):
            hvd.allreduce(x, name=f"g.{i}")
        hvd.join()
        print("HVDLITE_RESULT", json.dumps({"ok": True}))
        hvd.shutdown()
    """
    assert_ok(run_job(NP, script, timeout=120, env={"HVDLITE_TIMELINE": str(path)}))
    events = read_trace(path)
    by_track = spans_by_track(events)
    tid_of = {name: tid for tid, name in track_names(events).items()}
    # g.2 and g.3 were submitted by rank 1 only: the negotiation opens when its request
    # reaches the coordinator.
    for name in ("g.2", "g.3"):
        kinds = [s["name"] for s in by_track[tid_of[name]]]
        assert kinds == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"], kinds
        marks = [m["name"] for m in by_track[tid_of[name]][0]["marks"]]
        assert marks == ["rank 1 ready"], marks


def test_summary_reads_a_file_cut_short(training_trace, tmp_path):
    path, allreduced, transport = training_trace
    lines = path.read_text().splitlines(keepends=True)
    whole = len(read_trace(path))
    # Cut in the middle of an event line, as a crash during a write would.
    keep = len(lines) // 2
    cut = tmp_path / "cut.json"
    cut.write_text("".join(lines[:keep]) + lines[keep][: len(lines[keep]) // 2])
    _, summary = summary_of(cut)
    assert any("not a whole event" in p for p in summary["problems"]), summary["problems"]
    # Every whole line before the cut was read: one event per line after the "[".
    assert summary["events"] == keep - 1 < whole
    assert sum(a["count"] for a in summary["activities"]) > 0
    # Without the closing bracket only (a kill between two writes).
    cut.write_text("".join(lines[:-1]).rstrip())
    _, summary = summary_of(cut)
    assert summary["problems"]
    assert sum(a["count"] for a in summary["activities"]) == sum(
        a["count"] for a in summary_of(path)[1]["activities"])


def test_summary_after_a_rank_crashed(tmp_path):
    path = tmp_path / "crash.json"
    script = """
        import os, sys, time
        import numpy as np
        import hvdlite as hvd
        hvd.init()
        for i in range(20):
            hvd.allreduce(np.ones(64, np.float32), name=f"t.{i % 4}")
        if hvd.rank() == 0:
            # The writer flushes every 100 ms, at a low priority: wait until the file
            # holds the 20 operations and their ends (a crash keeps what was flushed).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with open(sys.argv[1]) as f:
                    text = f.read()
                if text.count('"name": "ALLREDUCE"') >= 20 and text.count('"ph": "B"') == text.count('"ph": "E"'):
                    break
                time.sleep(0.05)
            os._exit(3)  # no shutdown: the file has no closing bracket
        time.sleep(30)
    """
    result = run_job(NP, script, args=[path], timeout=120, env={"HVDLITE_TIMELINE": str(path)})
    assert result.returncode != 0
    text = path.read_text()
    assert not text.rstrip().endswith("]")
    _, summary = summary_of(path)
    assert summary["problems"]
    assert {t["name"] for t in summary["tensors"]} == {"t.0", "t.1", "t.2", "t.3"}
    assert sum(t["ops"] for t in summary["tensors"]) == 20


def test_unwritable_path_is_an_error_at_the_call(tmp_path):
    bad = tmp_path / "no" / "such" / "dir" / "t.json"
    script = """
        import json, sys
        import hvdlite as hvd
        hvd.init()
        try:
            hvd.start_timeline(sys.argv[1])
            outcome = "ok"
        except hvd.errors.InvalidArgumentError as e:
            outcome = str(e)
        print("HVDLITE_RESULT", json.dumps({"outcome": outcome}))
        hvd.shutdown()
    """
    result = assert_ok(run_job(NP, script, args=[bad], timeout=120))
    assert str(bad) in result.result(0)["outcome"]  # rank 0 writes the timeline
    assert result.result(1)["outcome"] == "ok"       # the others have nothing to open
    # Set at init: every rank fails, none waits for rank 0. Each rank leaves its error in
    # a file and exits only once every rank has: the launcher ends the other ranks as
    # soon as one exits, possibly before they could print their own error.
    init_script = """
        import os, sys, time, traceback
        import hvdlite as hvd
        rank, size = int(os.environ["HVDLITE_RANK"]), int(os.environ["HVDLITE_SIZE"])
        out_dir = sys.argv[1]
        try:
            hvd.init()
        except Exception:
            text = traceback.format_exc()
            sys.stderr.write(text)
            with open(os.path.join(out_dir, f"{rank}.tmp"), "w") as f:
                f.write(text)
            os.rename(os.path.join(out_dir, f"{rank}.tmp"), os.path.join(out_dir, f"init.{rank}"))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and sum(
                    n.startswith("init.") for n in os.listdir(out_dir)) < size:
                time.sleep(0.05)
            sys.exit(1)
    """
    out_dir = tmp_path / "init_errors"
    out_dir.mkdir()
    result = run_job(NP, init_script, args=[out_dir], timeout=120,
                     env={"HVDLITE_TIMELINE": str(bad)})
    assert result.returncode != 0
    errors = {p.name: p.read_text() for p in out_dir.iterdir() if p.name.startswith("init.")}
    assert set(errors) == {f"init.{r}" for r in range(NP)}, (errors, result.stderr)
    assert str(bad) in errors["init.0"]
    assert "rank 0 cannot write the timeline" in errors["init.1"]


# -- the ring between the background loop and the writer, driven through testing.h ----

def record_steps(path, tensors, steps, ring_words, hold_writer=False, drain_every=0):
    """Runs hvdlite_test_timeline_steps; returns (lines asked for other than E, dropped)."""
    from hvdlite._native import ffi, lib
    asked, dropped = ffi.new("int64_t *"), ffi.new("int64_t *")
    status = lib.hvdlite_test_timeline_steps(str(path).encode(), tensors, steps, ring_words,
                                             int(hold_writer), drain_every, asked, dropped)
    assert status == lib.HVDLITE_OK, ffi.string(lib.hvdlite_last_error()).decode()
    return asked[0], dropped[0]


def check_named_before_use(events):
    """Every track's name line comes before the track's first event."""
    named = {0}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            named.add(e["tid"])
        elif "tid" in e:
            assert e["tid"] in named, f"track {e['tid']} used before it was named: {e}"


def check_step(negotiate, op, tensors):
    """One step of hvdlite_test_timeline_steps on one track, recorded in full."""
    assert negotiate["name"] == "NEGOTIATE_ALLREDUCE" and op["name"] == "ALLREDUCE"
    assert [m["name"] for m in negotiate["marks"]] == ["rank 0 ready", "all ranks ready"]
    assert [c["name"] for c in op["children"]] == ["QUEUE", "SHM_ALLREDUCE"]
    assert op["args"] == {"dtype": "float32", "shape": "[4]", "bytes": 16, "fused": tensors}


def test_every_event_survives_a_ring_that_wraps(tmp_path):
    # 7 tracks x 40 steps x 8 lines through a ring of 512 words, drained every 2 steps:
    # the ring wraps many times, and the writer always keeps up, so nothing may be lost.
    path, tensors, steps, ring_words = tmp_path / "wrap.json", 7, 40, 512
    asked, dropped = record_steps(path, tensors, steps, ring_words, drain_every=2)
    assert (asked, dropped) == (6 * tensors * steps, 0)
    events = read_trace(path)
    timed = [e for e in events if "ts" in e]
    assert len(timed) > ring_words  # at least a word a line: the ring wrapped
    assert not [e for e in events if e.get("name") == "EVENTS_DROPPED"]
    check_named_before_use(events)
    tid_of = {name: tid for tid, name in track_names(events).items() if tid != 0}
    assert set(tid_of) == {f"t.{i}" for i in range(tensors)}
    by_track = spans_by_track(events)
    for i in range(tensors):
        tid = tid_of[f"t.{i}"]
        ts = [e["ts"] for e in timed if e["tid"] == tid]
        assert ts == sorted(ts), f"t.{i}: timestamps go backwards"
        spans = by_track[tid]
        assert len(spans) == 2 * steps, f"t.{i}: {len(spans) // 2} of {steps} steps"
        for negotiate, op in zip(spans[::2], spans[1::2]):
            check_step(negotiate, op, tensors)


@pytest.mark.parametrize("tensors,ring_words", [(5, 256), (200, 4096)])
def test_a_full_ring_drops_whole_spans_and_counts_every_lost_line(tmp_path, tensors, ring_words):
    # The writer is held while 60 steps are recorded: the ring fills in the first steps.
    # (200 tracks: a fused record is cut part way through its tracks.)
    path, steps = tmp_path / "full.json", 60
    asked, dropped = record_steps(path, tensors, steps, ring_words, hold_writer=True)
    assert asked == 6 * tensors * steps
    assert 0 < dropped < asked
    events = read_trace(path)  # still valid JSON
    counts = [e["args"]["count"] for e in events if e.get("name") == "EVENTS_DROPPED"]
    assert sum(counts) == dropped
    written = [e for e in events if e.get("ph") in ("B", "i", "X") and e.get("tid", 0) != 0]
    assert len(written) + dropped == asked  # nothing lost without being counted
    check_named_before_use(events)
    by_track = spans_by_track(events)  # every recorded B has its E
    # What fit is what came first: both rings hold the whole first step.
    tid_of = {name: tid for tid, name in track_names(events).items() if tid != 0}
    assert set(tid_of) == {f"t.{i}" for i in range(tensors)}
    for tid in tid_of.values():
        check_step(*by_track[tid][:2], tensors)
    for spans in by_track.values():
        for s in spans:
            if s["name"] == "ALLREDUCE":
                # An activity is only ever written inside its recorded span.
                assert [c["name"] for c in s["children"]] in (
                    [], ["QUEUE"], ["QUEUE", "SHM_ALLREDUCE"]), s
