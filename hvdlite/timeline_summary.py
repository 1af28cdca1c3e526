"""Reads an hvdlite timeline (Chrome trace JSON) and summarizes or draws it.

    events, problems = read_events("timeline.json")
    summary = summarize(events)
    print(format_summary(summary))
    plot(events, "timeline.png")

The file is what rank 0 recorded (see the README, "Timeline"): one track per tensor name,
on it a ``NEGOTIATE_<OP>`` span with ``rank N ready`` marks, then the ``<OP>`` span
(args: dtype, shape, bytes, fused) with nested ``QUEUE``, ``MEMCPY_IN_FUSION_BUFFER``,
the collective (``MPI_<OP>``, ``SHM_ALLREDUCE``, ``NCCL_<OP>``) and ``MEMCPY_OUT_FUSION_BUFFER``.

Definitions used by the summary:

- Activity total: the sum of the durations of every span of that name over all tracks
  (a fused allreduce of 10 tensors counts 10 times); wall: the length of the union of
  those spans in time (each moment counted once).
- Negotiation wait of one negotiation: the time from its first to its last readiness
  mark (``rank N ready``; on the response-cache path rank 0 sees only ``rank 0 ready``
  and ``all ranks ready``). The straggler signal; "last ready" counts which rank's mark
  came last (coordinator path only).
- Step: negotiations taken in time order; a step ends when a tensor name comes back.
- Overlap with backprop: per step, backprop is taken to end at the last negotiation
  start of the step (the moment the last gradient reached hvdlite on rank 0, or on an
  earlier rank). The overlapped share is the part of the step's communication wall
  time (the union of its ``MPI_*``/``SHM_*``/``NCCL_*`` spans) that lies before that moment,
  summed over steps, divided by the communication wall time. This is rank 0's view.
"""
import json
import os
from collections import defaultdict

__all__ = ["read_events", "build_spans", "summarize", "format_summary", "plot",
           "COMMUNICATION_PREFIXES"]

# Activities that are the collective itself (time on the wire).
COMMUNICATION_PREFIXES = ("MPI_", "SHM_", "NCCL_")
NEGOTIATION_PREFIX = "NEGOTIATE_"


def read_events(path):
    """Reads the events of a timeline, tolerating a file cut short by a crash.

    A file whose run stopped normally is a JSON array. One cut short (no closing
    bracket, a torn last event) is read event by event up to the first unreadable one.

    Args:
        path: the timeline file.

    Returns:
        (events, problems): the list of event dicts, and a list of strings that say
        what could not be read (empty for a complete file).

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not a Chrome trace at all.
    """
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        data = data["traceEvents"]
    if isinstance(data, list):
        return [e for e in data if isinstance(e, dict)], []
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise ValueError(f"{path}: not a Chrome trace (JSON array of events)")
    decoder = json.JSONDecoder()
    events, pos, problems = [], start + 1, []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            problems.append("the file ends without its closing ']' (the run did not stop "
                            "the timeline: a crash or a kill?)")
            break
        if text[pos] == "]":
            break
        try:
            event, pos = decoder.raw_decode(text, pos)
        except ValueError:
            problems.append(f"the last {len(text) - pos} bytes are not a whole event "
                            "(torn by a crash?) and were skipped")
            break
        if isinstance(event, dict):
            events.append(event)
    return events, problems


class Span:
    """One span on a track: a B..E pair or a complete (X) event."""

    __slots__ = ("tid", "name", "start", "end", "depth", "args", "parent", "step", "finished",
                 "marks")

    def __init__(self, tid, name, start, depth, args, parent):
        self.tid, self.name, self.start, self.depth = tid, name, start, depth
        self.args, self.parent = args or {}, parent
        self.end, self.step, self.finished, self.marks = start, None, False, []

    @property
    def duration(self):
        return self.end - self.start


def build_spans(events):
    """Matches B/E events per track; complete (X) events nest in the span open there.

    Args:
        events: event dicts as read by read_events.

    Returns:
        dict with ``tracks`` (tid -> name), ``spans`` (Span list in start order),
        ``instants`` (per-track instant events), ``end_ts`` (the last timestamp, µs),
        ``unfinished`` (spans still open at the end of the file: closed at end_ts),
        ``unmatched_ends`` and ``dropped`` (the writer's EVENTS_DROPPED count).
    """
    tracks, spans, instants = {}, [], []
    stacks = defaultdict(list)
    unmatched, dropped, end_ts = 0, 0, 0
    for e in events:
        ph, tid = e.get("ph"), e.get("tid", 0)
        if ph == "M":
            if e.get("name") == "thread_name":
                tracks[tid] = str(e.get("args", {}).get("name", tid))
            continue
        ts = e.get("ts")
        if not isinstance(ts, (int, float)):
            continue
        end_ts = max(end_ts, ts)
        if ph == "B":
            stack = stacks[tid]
            span = Span(tid, e.get("name", ""), ts, len(stack), e.get("args"),
                        stack[-1] if stack else None)
            stack.append(span)
            spans.append(span)
        elif ph == "E":
            stack = stacks[tid]
            if not stack:
                unmatched += 1
                continue
            span = stack.pop()
            span.end, span.finished = ts, True
            if isinstance(e.get("args"), dict):
                span.args.update(e["args"])
        elif ph == "X":
            # A complete activity, written once it ended: nested in the track's open span.
            stack = stacks[tid]
            span = Span(tid, e.get("name", ""), ts, len(stack), e.get("args"),
                        stack[-1] if stack else None)
            span.end, span.finished = ts + e.get("dur", 0), True
            end_ts = max(end_ts, span.end)
            spans.append(span)
        elif ph in ("i", "I"):
            if e.get("name") == "EVENTS_DROPPED":
                dropped += int(e.get("args", {}).get("count", 0))
            elif tid:
                instants.append(e)
                stack = stacks[tid]
                if stack:
                    stack[0].marks.append(e)
    unfinished = [s for s in spans if not s.finished]
    for s in unfinished:
        s.end = end_ts
    # Complete events follow their parents in the file but may follow later starts on
    # other tracks: back to start order (parents before children).
    spans.sort(key=lambda s: (s.start, s.depth))
    return {"tracks": tracks, "spans": spans, "instants": instants, "end_ts": end_ts,
            "unfinished": len(unfinished), "unmatched_ends": unmatched, "dropped": dropped}


def _assign_steps(spans):
    """Numbers steps: negotiations in start order, a new step when a name comes back."""
    step, seen = 0, set()
    last_op = {}  # tid -> step of its latest negotiation
    for s in spans:  # start order
        if s.depth == 0 and s.name.startswith(NEGOTIATION_PREFIX):
            if s.tid in seen:
                step, seen = step + 1, set()
            seen.add(s.tid)
            s.step = step
            last_op[s.tid] = step
        elif s.depth == 0:
            s.step = last_op.get(s.tid, step)
        else:
            s.step = s.parent.step
    return step + 1 if spans else 0


def _union_length(intervals, until=None):
    """Length of the union of (start, end) intervals, clipped at ``until`` if given."""
    total, cur_start, cur_end = 0.0, None, None
    for a, b in sorted(intervals):
        if until is not None:
            b = min(b, until)
            if b <= a:
                continue
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _is_communication(name):
    return name.startswith(COMMUNICATION_PREFIXES)


def summarize(events):
    """Computes the summary of a timeline.

    Args:
        events: event dicts as read by read_events.

    Returns:
        A dict (JSON-serializable; times in milliseconds): ``events``, ``duration_ms``, ``steps``,
        ``activities`` (name, count, total_ms, mean_ms, wall_ms), ``tensors`` (name, ops,
        bytes, negotiations, wait_mean_ms, wait_max_ms, last_ready), ``bytes_total``,
        ``communication`` (wall_ms, overlapped_ms, overlap_share), and the counts
        ``unfinished_spans``, ``unmatched_ends``, ``dropped_events``. The module
        docstring defines each figure.
    """
    built = build_spans(events)
    spans, tracks = built["spans"], built["tracks"]
    steps = _assign_steps(spans)

    by_name = defaultdict(list)
    for s in spans:
        by_name[s.name].append(s)
    activities = []
    for name, group in by_name.items():
        total = sum(s.duration for s in group)
        activities.append({
            "name": name, "count": len(group), "total_ms": total / 1e3,
            "mean_ms": total / len(group) / 1e3,
            "wall_ms": _union_length([(s.start, s.end) for s in group]) / 1e3,
        })
    activities.sort(key=lambda a: (-a["total_ms"], a["name"]))

    per_tensor = {}
    for tid, name in tracks.items():
        if tid:
            per_tensor[tid] = {"name": name, "ops": 0, "bytes": 0, "negotiations": 0,
                               "waits": [], "last_ready": defaultdict(int)}
    for s in spans:
        info = per_tensor.get(s.tid)
        if info is None or s.depth != 0:
            continue
        if s.name.startswith(NEGOTIATION_PREFIX):
            info["negotiations"] += 1
            ready = [m for m in s.marks if str(m.get("name", "")).endswith(" ready")]
            if ready:
                times = [m["ts"] for m in ready]
                info["waits"].append(max(times) - min(times))
                last = max(ready, key=lambda m: m["ts"])
                if len(ready) > 1 and str(last.get("name", "")).startswith("rank "):
                    info["last_ready"][last["name"][:-len(" ready")]] += 1
        else:
            info["ops"] += 1
            info["bytes"] += int(s.args.get("bytes", 0) or 0)
    tensors = []
    for tid in sorted(per_tensor):
        info = per_tensor[tid]
        waits = info.pop("waits")
        info["wait_mean_ms"] = (sum(waits) / len(waits) / 1e3) if waits else 0.0
        info["wait_max_ms"] = (max(waits) / 1e3) if waits else 0.0
        info["last_ready"] = dict(info["last_ready"])
        tensors.append(info)

    comm_by_step = defaultdict(list)
    backprop_end = {}
    for s in spans:
        if s.depth == 0 and s.name.startswith(NEGOTIATION_PREFIX):
            backprop_end[s.step] = max(backprop_end.get(s.step, s.start), s.start)
        elif _is_communication(s.name):
            comm_by_step[s.step].append((s.start, s.end))
    comm_wall = overlapped = 0.0
    for step, intervals in comm_by_step.items():
        comm_wall += _union_length(intervals)
        if step in backprop_end:
            overlapped += _union_length(intervals, until=backprop_end[step])
    starts = [s.start for s in spans]
    return {
        "events": len(events),
        "duration_ms": (built["end_ts"] - min(starts)) / 1e3 if starts else 0.0,
        "steps": steps,
        "activities": activities,
        "tensors": tensors,
        "bytes_total": sum(t["bytes"] for t in tensors),
        "communication": {
            "wall_ms": comm_wall / 1e3,
            "overlapped_ms": overlapped / 1e3,
            "overlap_share": overlapped / comm_wall if comm_wall else 0.0,
        },
        "unfinished_spans": built["unfinished"],
        "unmatched_ends": built["unmatched_ends"],
        "dropped_events": built["dropped"],
    }


def _human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return str(n)


def _table(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    lines = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w)
                       for i, (h, w) in enumerate(zip(headers, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def format_summary(summary, top=20, problems=()):
    """Renders a summary (from summarize) as text tables.

    Args:
        summary: the dict from summarize.
        top: how many tensors to list (those with the longest negotiation wait first).
        problems: notes from read_events, printed first.

    Returns:
        The text.
    """
    out = [f"note: {p}" for p in problems]
    for key, what in (("unfinished_spans", "spans were still open at the end of the file "
                                           "(closed at its last timestamp)"),
                      ("dropped_events", "events were dropped by the writer (queue full)")):
        if summary.get(key):
            out.append(f"note: {summary[key]} {what}")
    comm = summary["communication"]
    out.append(f"{summary['duration_ms']:.1f} ms recorded, {summary['steps']} steps, "
               f"{len(summary['tensors'])} tensors, "
               f"{_human_bytes(summary['bytes_total'])} moved")
    out.append("")
    out.append(_table(
        ["activity", "count", "total ms", "mean ms", "wall ms"],
        [[a["name"], a["count"], f"{a['total_ms']:.3f}", f"{a['mean_ms']:.3f}",
          f"{a['wall_ms']:.3f}"] for a in summary["activities"]]))
    out.append("")
    tensors = sorted(summary["tensors"], key=lambda t: (-t["wait_max_ms"], t["name"]))
    shown = tensors[:top]
    rows = []
    for t in shown:
        last = "-"
        if t["last_ready"]:
            who, times = max(t["last_ready"].items(), key=lambda kv: kv[1])
            last = f"{who} ({times}/{t['negotiations']})"
        rows.append([t["name"], t["ops"], _human_bytes(t["bytes"]), f"{t['wait_mean_ms']:.3f}",
                     f"{t['wait_max_ms']:.3f}", last])
    title = "tensor" if len(shown) == len(tensors) else f"tensor ({len(shown)} of {len(tensors)})"
    out.append(_table([title, "ops", "bytes", "wait mean ms", "wait max ms", "last ready"],
                      rows))
    out.append("last ready: the rank whose request reached the coordinator last, most often "
               "(of the negotiations; cached ones show only 'all ranks ready')")
    out.append("")
    out.append(f"communication (MPI_*/SHM_*/NCCL_* wall time): {comm['wall_ms']:.3f} ms, "
               f"{comm['overlapped_ms']:.3f} ms of it before the step's last gradient was "
               f"ready: {100 * comm['overlap_share']:.1f}% overlapped backprop")
    return "\n".join(out)


# Activity -> colour in the picture; ops not listed take the op colour.
_COLOURS = {
    "QUEUE": "#f2c14e",
    "MEMCPY_IN_FUSION_BUFFER": "#5fad56",
    "MEMCPY_OUT_FUSION_BUFFER": "#4d9078",
    "CYCLE_START": "#999999",
}
_NEGOTIATION_COLOUR = "#c9c9c9"
_OP_COLOUR = "#8fb8de"
_COMM_COLOUR = "#d1495b"


def _colour(name):
    if name in _COLOURS:
        return _COLOURS[name]
    if name.startswith(NEGOTIATION_PREFIX):
        return _NEGOTIATION_COLOUR
    if _is_communication(name):
        return _COMM_COLOUR
    return _OP_COLOUR


def plot(events, out_path, max_tracks=40, start_ms=None, end_ms=None, title=None):
    """Draws a Gantt-style picture: one row per tensor track, spans as bars over time.

    Args:
        events: event dicts as read by read_events.
        out_path: the image to write (PNG, or any format matplotlib knows by extension).
        max_tracks: draw at most this many tracks (the first ones recorded).
        start_ms, end_ms: the time window to draw (ms from the start of the trace).
        title: the picture's title.

    Returns:
        The number of bytes written.

    Raises:
        ImportError: matplotlib is not installed.
    """
    # Lazy: matplotlib is optional (only --plot needs it), and the backend must be
    # chosen before pyplot is imported.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    built = build_spans(events)
    tids = [t for t in sorted(built["tracks"]) if t][:max_tracks]
    row = {tid: i for i, tid in enumerate(tids)}
    spans = [s for s in built["spans"] if s.tid in row]
    origin = min((s.start for s in built["spans"]), default=0)
    lo = -float("inf") if start_ms is None else start_ms * 1e3 + origin
    hi = float("inf") if end_ms is None else end_ms * 1e3 + origin
    spans = [s for s in spans if s.end >= lo and s.start <= hi]

    height = max(2.5, 0.22 * len(tids) + 1.4)
    fig, ax = plt.subplots(figsize=(10, height), dpi=100)
    bar_height = {0: 0.8, 1: 0.55, 2: 0.35}
    groups = defaultdict(lambda: ([], [], [], []))
    for s in spans:
        y, w, left, h = groups[(s.name, min(s.depth, 2))]
        a, b = max(s.start, lo), min(s.end, hi)
        y.append(row[s.tid])
        left.append((a - origin) / 1e3)
        w.append(max((b - a) / 1e3, 0.0))
        h.append(bar_height[min(s.depth, 2)])
    for (name, depth), (y, w, left, h) in sorted(groups.items(), key=lambda kv: kv[0][1]):
        ax.barh(y, w, left=left, height=h, color=_colour(name), linewidth=0, zorder=2 + depth)
    marks = [(row[m["tid"]], (m["ts"] - origin) / 1e3) for m in built["instants"]
             if m.get("tid") in row and lo <= m["ts"] <= hi]
    if marks:
        ax.scatter([t for _, t in marks], [y for y, _ in marks], marker="|", s=40,
                   color="black", linewidths=0.8, zorder=6)
    ax.set_yticks(range(len(tids)))
    ax.set_yticklabels([built["tracks"][t] for t in tids], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time since the timeline started (ms)")
    ax.grid(axis="x", color="#eeeeee", zorder=0)
    if start_ms is not None or end_ms is not None:
        ax.set_xlim(left=start_ms if start_ms is not None else None,
                    right=end_ms if end_ms is not None else None)
    legend = {}
    for s in sorted(spans, key=lambda s: (s.depth, s.start)):
        if s.name.startswith(NEGOTIATION_PREFIX):
            label = "NEGOTIATE_<OP>"
        elif _is_communication(s.name):
            label = s.name.split("_", 1)[0] + "_<OP> (collective)"
        elif s.depth == 0:
            label = "<OP>"
        else:
            label = s.name
        legend.setdefault(label, _colour(s.name))
    handles = [Patch(color=c, label=n) for n, c in legend.items()]
    if marks:
        handles.append(Line2D([], [], color="black", marker="|", linestyle="",
                              label="rank ready"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False)
    shown = f" ({len(tids)} of {len([t for t in built['tracks'] if t])} tracks)" \
        if len(tids) < len([t for t in built["tracks"] if t]) else ""
    ax.set_title((title or "hvdlite timeline (rank 0)") + shown, fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return os.path.getsize(out_path)
