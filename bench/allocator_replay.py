"""Replay a recorded CUDA caching-allocator event log through tiersep's allocator model.

The log (`*.events.json.gz`, see tests/data/gpu/h100-2026-11-22/README.md) holds the alloc /
free_completed sequence of a real run; the model rounds the requested sizes, rebuilds the state the
allocator had when the log began, and replays it. Native mode compares the segments it creates and
its reserved/allocated peaks with the log's own; `--expandable-segments` replays the same sequence
with expandable segments and compares with the run measured that way (expandable_segments.jsonl).

    python bench/allocator_replay.py tests/data/gpu/h100-2026-11-22/events/small_as_shipped.events.json.gz
    python bench/allocator_replay.py FILE.events.json.gz --expandable-segments [--reference FILE.jsonl]

The last line printed is the JSON report. A file that does not parse: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tiersep.memory.trace.allocator import (EventLogError, load_event_log, load_expandable_reference,
                                      replay_report)

MIB = 2**20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--expandable-segments", action="store_true")
    parser.add_argument("--reference", type=Path,
                        help="expandable_segments.jsonl to compare with (default: the one beside the "
                             "log's events/ folder, if any)")
    parser.add_argument("--synthetic-addresses", action="store_true",
                        help="give segments increasing addresses instead of the recorded ones")
    args = parser.parse_args(argv)
    try:
        log = load_event_log(args.log)
        reference = None
        if args.expandable_segments:
            ref = args.reference or args.log.resolve().parent.parent / "expandable_segments.jsonl"
            if args.reference or ref.exists():
                reference = load_expandable_reference(ref, log.name)
        report = replay_report(log, args.expandable_segments, reference,
                               recorded_addresses=not args.synthetic_addresses)
    except EventLogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    rec = report["recorded"]

    def line(what, model, recorded, err):
        if recorded is None:
            return f"{what:<16} {model / MIB:12.1f} MiB   (nothing recorded to compare)"
        return f"{what:<16} {model / MIB:12.1f} MiB   recorded {recorded / MIB:12.1f} MiB   {err:+.3%}"

    print(f"{report['name']} ({report['mode']})")
    print(line("reserved peak", report["reserved_peak_bytes"], rec["reserved_peak_bytes"],
               report["reserved_peak_error"]))
    print(line("allocated peak", report["allocated_peak_bytes"], rec["allocated_peak_bytes"],
               report["allocated_peak_error"]))
    if "segments_match" in report:
        print(f"segments         {len(report['segments'])} created, {len(rec['segments'])} recorded, "
              f"{'identical sequence' if report['segments_match'] else 'sequences differ'}; "
              f"allocs at another address than recorded: {report['address_mismatches']}")
    else:
        print(f"page mappings    {len(report['segments'])} ({sum(report['segments']) / MIB:.0f} MiB)")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
