"""The ``hvdlite`` command: tools around a run (the launcher is ``hvdliterun``).

    hvdlite timeline summary FILE [--plot out.png] [--json] [--top N]
"""
import argparse
import json
import sys

from hvdlite import timeline_summary


def _parser():
    parser = argparse.ArgumentParser(prog="hvdlite", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    timeline = commands.add_parser("timeline", help="read a timeline written by a run")
    timeline_commands = timeline.add_subparsers(dest="timeline_command", metavar="ACTION",
                                                required=True)
    summary = timeline_commands.add_parser(
        "summary", help="print per-activity times, negotiation waits, bytes and overlap",
        description="Summarizes a Chrome-trace timeline written by hvdlite "
                    "(HVDLITE_TIMELINE, hvdliterun --timeline-filename, start_timeline). "
                    "A file cut short by a crash is read up to its last whole event.")
    summary.add_argument("file", help="the timeline JSON file")
    summary.add_argument("--plot", metavar="OUT.png",
                         help="also draw a Gantt-style picture of the tracks (matplotlib)")
    summary.add_argument("--json", action="store_true",
                         help="print the summary as JSON instead of tables")
    summary.add_argument("--top", type=int, default=20, metavar="N",
                         help="tensors to list, longest negotiation wait first (default 20)")
    summary.add_argument("--max-tracks", type=int, default=40, metavar="N",
                         help="tracks to draw in the picture (default 40)")
    summary.add_argument("--start-ms", type=float, help="picture: start of the time window")
    summary.add_argument("--end-ms", type=float, help="picture: end of the time window")
    return parser


def _timeline_summary(args):
    try:
        events, problems = timeline_summary.read_events(args.file)
    except (OSError, ValueError) as e:
        print(f"hvdlite: cannot read the timeline: {e}", file=sys.stderr)
        return 2
    summary = timeline_summary.summarize(events)
    if args.json:
        summary["problems"] = problems
        print(json.dumps(summary, indent=1))
    else:
        print(timeline_summary.format_summary(summary, top=args.top, problems=problems))
    if args.plot:
        try:
            size = timeline_summary.plot(events, args.plot, max_tracks=args.max_tracks,
                                         start_ms=args.start_ms, end_ms=args.end_ms)
        except ImportError as e:
            print(f"hvdlite: --plot needs matplotlib ({e})", file=sys.stderr)
            return 2
        print(f"wrote {args.plot} ({size} bytes)", file=sys.stderr)
    return 0


def main(argv=None):
    """Entry point of the ``hvdlite`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "timeline" and args.timeline_command == "summary":
        return _timeline_summary(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
