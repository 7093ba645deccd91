"""The accuracy evidence: CUDA estimates against real GPU measurements, by class.

Reads the measurement folders (tests/data/gpu/<gpu>-<date>/, the shared measurement format: one
JSON object per line with preset, set, max_memory_allocated, max_memory_reserved, device_used_bytes;
`PYTORCH_CUDA_ALLOC_CONF` says the allocator mode, `compiled` a torch.compile'd step), estimates
every configuration as the measured run ran it (the model of the measured commit, read from git;
that GPU's calibration) and compares allocated, reserved and device use. The CI accuracy test runs
exactly this; `--write` stores the per-class result the estimate books (accuracy_evidence.json) and
the table of docs/memory.md, `--check` says whether both are current.

    python -m tiersep.memory.evidence --check | --write [--data tests/data/gpu]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from . import accuracy

ROOT = Path(__file__).resolve().parents[3]
DATA_ROOT = ROOT / "tests" / "data" / "gpu"
DOC = ROOT / "docs" / "memory.md"
BEGIN, END = "<!-- accuracy-by-class: begin (python -m tiersep.memory.evidence --write) -->", \
    "<!-- accuracy-by-class: end -->"
# Folders measured before measurement folders carried a manifest.json (their README says so).
LEGACY = {"h100-2026-11-22": {"commit": "e74010960b93", "gpu": "NVIDIA H100 80GB HBM3"}}
# What the estimate's GPU figures were fitted on, so that accuracy is judged on the other rows:
# - the built-in H100 calibration's context_bytes is the largest device use outside torch's reserved
#   memory over the legacy folder's rows (its `source` field): refitted leaving each row out;
# - the cuDNN workspace rules (trace/kernels.py: cudnn_workspace) were read off these event logs: the
#   configurations they record are in sample for the rules, in either allocator mode, on any GPU.
CONTEXT_FITTED_ON = frozenset(LEGACY)
RULES_READ_FROM = DATA_ROOT / "h100-2026-11-22" / "events"
MEASURED = ("preset", "set", "max_memory_allocated", "max_memory_reserved", "device_used_bytes")
ALLOCATED_TOLERANCE, RESERVED_TOLERANCE = 0.005, accuracy.TARGET


def manifest(folder: Path) -> dict:
    """What a measurement folder was measured with: commit, gpu, calibration file, dry_run."""
    path = folder / "manifest.json"
    if path.is_file():
        return json.loads(path.read_text())
    return LEGACY.get(folder.name, {})


def load_rows(root: Path = DATA_ROOT) -> list[dict]:
    """Every measured configuration under `root` (dry runs left out: they measured no GPU)."""
    rows = []
    for folder in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        info = manifest(folder)
        if info.get("dry_run") or "commit" not in info:
            continue
        for path in sorted(folder.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                row = json.loads(line) if line.strip() else {}
                if not all(k in row for k in MEASURED) or row.get("dry_run"):
                    continue   # speed.jsonl and the like, or not a GPU measurement
                conf = row.get("PYTORCH_CUDA_ALLOC_CONF") or ""
                calibration = folder / info["calibration"] if info.get("calibration") else None
                rows.append(dict(row, folder=folder.name, source=path.name,
                                 expandable_segments="expandable_segments:True" in conf,
                                 compiled=bool(row.get("compiled")), commit=row.get("commit", info["commit"]),
                                 calibration=str(calibration) if calibration else row.get("gpu", info["gpu"])))
    return rows


def row_id(row: dict) -> str:
    return f"{row['name']}-{'exp' if row['expandable_segments'] else 'native'}" + \
        ("-compiled" if row["compiled"] else "") + \
        ("" if row["folder"] in LEGACY else f"@{row['folder']}")


def preset_of(row: dict) -> dict:
    from tiersep import config as C

    preset = C.load_preset(row["preset"], {"presets_dir": str(ROOT / "config" / "presets")})
    for key, value in row["set"].items():
        preset = C.set_field(preset, key, value)
    preset = C.set_field(preset, "train.cuda_expandable_segments", row["expandable_segments"])
    return C.validate(preset, "preset.schema.yaml", f"{row['folder']}/{row['source']}: {row['name']}")


@contextlib.contextmanager
def measured_model(commit: str):
    """tiersep.model's build_model and build_loss as they were at `commit` (what the GPU ran), and no
    PYTORCH_CUDA_ALLOC_CONF of this shell (the allocator mode is the preset's)."""
    import tiersep.model
    from tiersep.model.at_revision import model_at

    package = model_at(commit, ROOT)
    saved = tiersep.model.build_model, tiersep.model.build_loss, os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    tiersep.model.build_model, tiersep.model.build_loss = package.build_model, package.build_loss
    try:
        yield
    finally:
        tiersep.model.build_model, tiersep.model.build_loss = saved[:2]
        if saved[2] is not None:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = saved[2]


def estimate_row(row: dict) -> dict:
    """The figures the estimate gives for a measured configuration. A compiled row is the compiled
    trace's (what the estimate books once such evidence exists: estimate._why_eager)."""
    from .estimate import estimate
    from .trace import trace_step

    preset = preset_of(row)
    with measured_model(row["commit"]):
        record = estimate(preset, "trace", "cuda", calibration_spec=row["calibration"], compiled=False)
        if row["compiled"]:
            r = trace_step(preset, "cuda", workspace_bytes=record["overhead_detail"]["cublas_workspace"],
                           expandable_segments=row["expandable_segments"], compiled=True)
            record = dict(record, allocated_peak_bytes=r.allocated_peak, reserved_peak_bytes=r.reserved_peak,
                          peak_bytes=r.reserved_peak + record["calibration"]["context_bytes"], compiled=True)
    return record


CHECKS = (("allocated", "allocated_peak_bytes", "max_memory_allocated", ALLOCATED_TOLERANCE),
          ("reserved", "reserved_peak_bytes", "max_memory_reserved", RESERVED_TOLERANCE),
          ("device", "peak_bytes", "device_used_bytes", RESERVED_TOLERANCE))


def compare(row: dict, record: dict) -> dict:
    """{what: (measured, predicted, error, within tolerance)} for allocated, reserved, device use."""
    out = {}
    for what, key, measured_key, tolerance in CHECKS:
        measured, predicted = row[measured_key], record[key]
        error = predicted / measured - 1
        out[what] = (measured, predicted, error, abs(error) <= tolerance)
    return out


def table(row: dict, checks: dict) -> str:
    lines = [f"{row['name']} ({row['folder']}/{row['source']}, "
             f"{'expandable segments' if row['expandable_segments'] else 'native'}, {row['steps']} steps):",
             f"  {'quantity':<12} {'measured':>16} {'predicted':>16} {'error':>9}"]
    for what, (measured, predicted, error, ok) in checks.items():
        lines.append(f"  {what:<12} {measured:>16,} {predicted:>16,} {error:>+9.3%}{'' if ok else '  <- out of bounds'}")
    return "\n".join(lines)


def outside_reserved(row: dict) -> int:
    """What a measured run used beyond torch's reserved memory: its CUDA context."""
    return row["device_used_bytes"] - row["max_memory_reserved"]


def rule_configurations(folder: Path = RULES_READ_FROM) -> list[tuple]:
    """(preset, set) of each configuration the workspace rules were read off."""
    import gzip

    return [(log["config"]["preset"], json.dumps(log["config"].get("set") or {}, sort_keys=True))
            for log in (json.load(gzip.open(p)) for p in sorted(Path(folder).glob("*.events.json.gz")))]


def out_of_sample(rows: list[dict], records: dict, rules_from: list[tuple] | None = None) -> dict:
    """{row_id: (device-use error with every fitted figure refitted without the row, or None when
    the row is in sample for a figure that cannot be refitted, what it was fitted on)}.

    context_bytes is refitted leaving the row out (the largest outside-reserved use of the other rows
    of its folder); the workspace rules are code, so a configuration they were read off stays in
    sample. A calibration measured by `tiersep calibrate` was fitted on no row."""
    rules_from = rule_configurations() if rules_from is None else rules_from
    out = {}
    for row in rows:
        key, fitted = row_id(row), []
        record = records[key]
        context = record["peak_bytes"] - record["reserved_peak_bytes"]
        if row["folder"] in CONTEXT_FITTED_ON:
            context = max((outside_reserved(r) for r in rows if r["folder"] == row["folder"] and r is not row),
                          default=None)
            fitted.append("context_bytes (" + ("no other row to refit it on)" if context is None
                                               else "refitted leaving it out)"))
        logged = (row["preset"], json.dumps(row["set"], sort_keys=True)) in rules_from
        if logged:
            fitted.append("workspace rules (read off its event log)")
        if context is None or logged:
            out[key] = (None, fitted)
            continue
        out[key] = (round((record["reserved_peak_bytes"] + context) / row["device_used_bytes"] - 1, 5), fitted)
    return out


def build(rows: list[dict], records: dict, rules_from: list[tuple] | None = None) -> dict:
    """The per-class evidence from measured rows and their estimate records (by row_id). A class books
    the uncertainty of its out-of-sample errors (accuracy.uncertainty_of_errors); with none, the
    no-evidence figure."""
    classes: dict = {}
    judged: dict = {}       # class key -> [(configuration, out-of-sample device-use error)]
    oos = out_of_sample(rows, records, rules_from)
    for row in rows:
        record = records[row_id(row)]
        cls = accuracy.estimate_class(record)
        key = accuracy.class_key(cls)
        errors = {what: round(err, 5) for what, (_, _, err, _) in compare(row, record).items()}
        oos_error, fitted = oos[row_id(row)]
        classes.setdefault(key, {"class": cls, "configurations": []})["configurations"].append(
            {"name": row["name"], "measured": f"{row['folder']}/{row['source']}",
             "allocated_error": errors["allocated"], "reserved_error": errors["reserved"],
             "device_error": errors["device"], "out_of_sample_error": oos_error, "fitted_on": fitted,
             # a job named held out that repeats a configuration the rules were read off is in sample
             "held_out": bool(row.get("held_out")) and oos_error is not None})
        if oos_error is not None:
            judged.setdefault(key, []).append((configuration(row), oos_error))
    out = []
    for key in sorted(classes, key=str):
        entry = classes[key]
        errors = [error for _, error in judged.get(key, [])]
        entry["uncertainty"] = accuracy.uncertainty_of_errors(errors) if errors else accuracy.NO_EVIDENCE_UNCERTAINTY
        entry["leave_one_out"] = leave_one_out(judged.get(key, []))
        out.append(entry)
    return {"note": "Generated by `python -m tiersep.memory.evidence --write` from the CI accuracy test's data "
                    "(tests/data/gpu); do not edit.",
            "target": accuracy.TARGET, "no_evidence_uncertainty": accuracy.NO_EVIDENCE_UNCERTAINTY, "classes": out}


def configuration(row: dict) -> str:
    """What was run, whatever card ran it: the preset, its changes, the allocator mode, compiled or not."""
    return json.dumps([row["preset"], row["set"], row["expandable_segments"], row["compiled"]], sort_keys=True)


def leave_one_out(errors: list[tuple[str, float]]) -> dict:
    """Out of sample: each configuration against the uncertainty its class books from the others
    (none left: the no-evidence figure). `errors`: (configuration, device-use error) per measurement;
    a configuration measured on two cards is left out with both measurements, since its twin would
    otherwise cover it. `covered` counts the measurements whose error the others' booking covers;
    `worst_gap`, how far the worst one was beyond it (0 when all are covered)."""
    gaps = []
    if not errors:
        return {"covered": 0, "of": 0, "worst_gap": 0.0}
    for left_out, error in errors:
        others = [e for config, e in errors if config != left_out]
        booked = accuracy.uncertainty_of_errors(others) if others else accuracy.NO_EVIDENCE_UNCERTAINTY
        gaps.append(-error - booked)
    return {"covered": sum(g <= 0 for g in gaps), "of": len(gaps), "worst_gap": round(max(0.0, *gaps), 5)}


def render(evidence: dict) -> str:
    """The docs/memory.md table: every class with GPU evidence, what it rests on and the uncertainty
    the gate books; one last line for every other class (each generation without a measurement)."""
    lines = [BEGIN, "| attention | dtype | checkpointing | allocator | step | generation | configurations measured | "
                    "device use | reserved | allocated | out of sample: device use | held out: device use | "
                    "left out: covered | booked uncertainty |",
             "|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    order = {"flash": 0, "efficient": 1, "math": 2}
    for entry in sorted(evidence["classes"], key=lambda e: (
            e["class"]["generation"], order.get(e["class"]["attention"], 3), e["class"]["dtype"],
            e["class"]["checkpointing"], e["class"]["allocator"], e["class"]["step"])):
        cls, configs = entry["class"], entry["configurations"]
        head = (f"| {cls['attention']} | {cls['dtype']} | {'yes' if cls['checkpointing'] else 'no'} | "
                f"{cls['allocator']} | {cls['step']} | {cls['generation']} |")

        def span(key, digits=2, rows=configs):
            values = [c[key] for c in rows if c[key] is not None]
            if not values:
                return "none"
            lo, hi = (f"{v:+.{digits}%}" for v in (min(values), max(values)))
            return f"{lo}..{hi}" if len(values) > 1 else lo
        names = "; ".join(c["name"] + ("" if c["measured"].split("/")[0] in LEGACY else
                                       f" ({c['measured'].split('/')[0]})") for c in configs)
        loo = entry["leave_one_out"]
        missed = f" (worst {loo['worst_gap']:.1%} beyond)" if loo["worst_gap"] else ""
        n_oos = sum(c["out_of_sample_error"] is not None for c in configs)
        booked = f"{entry['uncertainty']:.1%}" + ("" if n_oos else " (none out of sample)")
        lines.append(f"{head} {len(configs)}: {names} | {span('device_error')} | {span('reserved_error')} | "
                     f"{span('allocated_error', 3)} | {span('out_of_sample_error')} ({n_oos} of {len(configs)}) | "
                     f"{span('device_error', rows=[c for c in configs if c['held_out']])} "
                     f"| {loo['covered']} of {loo['of']}{missed} | {booked} |")
    lines.append(f"| any other | | | | | any other | none | | | | | | | "
                 f"{evidence['no_evidence_uncertainty']:.1%} (no evidence) |")
    return "\n".join(lines + [END])


def doc_block(text: str) -> str | None:
    """The generated table as it stands in docs/memory.md, or None when the markers are missing."""
    if BEGIN not in text or END not in text:
        return None
    return text[text.index(BEGIN):text.index(END) + len(END)]


def records_of(rows: list[dict]) -> dict:
    return {row_id(row): estimate_row(row) for row in rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA_ROOT, help="measurement folders (default tests/data/gpu)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", action="store_true", help="write accuracy_evidence.json and the docs table")
    what.add_argument("--check", action="store_true", help="exit 1 when either is out of date")
    args = parser.parse_args(argv)
    rows = load_rows(args.data)
    evidence = build(rows, records_of(rows))
    text = json.dumps(evidence, indent=1) + "\n"
    doc = DOC.read_text()
    if doc_block(doc) is None:
        print(f"error: {DOC}: the markers of the accuracy table are missing ({BEGIN})", file=sys.stderr)
        return 2
    if args.write:
        from tiersep.io import write_text

        write_text(accuracy.EVIDENCE_FILE, text)
        write_text(DOC, doc.replace(doc_block(doc), render(evidence)))
        print(f"wrote {accuracy.EVIDENCE_FILE} and the table in {DOC} ({len(rows)} configurations)")
        return 0
    stale = [str(p) for p, ok in ((accuracy.EVIDENCE_FILE, accuracy.EVIDENCE_FILE.is_file() and
                                   accuracy.EVIDENCE_FILE.read_text() == text),
                                  (DOC, doc_block(doc) == render(evidence))) if not ok]
    print("stale: " + ", ".join(stale) if stale else "current")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
